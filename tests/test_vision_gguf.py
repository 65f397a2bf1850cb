"""GGUF + projector: the llama.cpp runner reads images through libmtmd like twinfer's torch graph.

The tiny Gemma 3 vision checkpoint (tests/vision_models.py) goes through llama.cpp's own converter: the text
model to tiny.gguf, the SigLIP tower and projector to mmproj-tiny.gguf (`--mmproj`), beside it so the runner
picks it up. The same prompt ids and image run through twinfer's torch graph on the checkpoint and through
the llama.cpp runner (features from mtmd, decoded as embeddings with non-causal attention inside the image):
the next-token distributions of the text after the image agree within a mean KL of 0.01. Another image
moves llama.cpp's logits, the same image gives the same ones, and causal attention inside the image is
measurably further from the reference.
"""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from vision_models import BOI, SPECIALS, VOCAB, VOCAB_SIZE, random_pixels, save_tiny_gemma3_vision

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.loaders import load_model
from twinfer.runtime.runner import Runner
from twinfer.runtime.tokenizer import load_tokenizer
from twinfer.runtime.vision import ChunkImage, Image, ImageSpan

pytest.importorskip("llama_cpp.mtmd_cpp")
torch = pytest.importorskip("torch")
from gguf_convert import convert  # noqa: E402

from twinfer.backends.cuda.runner import load_torch_runner  # noqa: E402
from twinfer.backends.llamacpp.options import LlamaCppOptions  # noqa: E402
from twinfer.backends.llamacpp.runner import LlamaCppRunner  # noqa: E402
from twinfer.backends.llamacpp.vision import LlamaCppVision  # noqa: E402

KL_LIMIT = 0.01
BLOCK = 16
SPLIT = 6  # a prefill chunk of text only; the image lies wholly in the next one
TEXT_PROMPT = "<bos><start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"
IMAGE_PROMPT = ("<bos><start_of_turn>user\nLook:\n<start_of_image>what is it? The quick brown fox jumps over "
                "the lazy dog.<end_of_turn>\n<start_of_turn>model\n")
_DIR = Path(tempfile.mkdtemp(prefix="twinfer-gguf-vision-"))


@cache
def hf_folder() -> Path:
    return save_tiny_gemma3_vision(_DIR / "hf")


def _released_names(path: Path) -> None:
    """Rewrite the safetensors with SigLIP under `vision_tower.vision_model.`, as released checkpoints
    (and llama.cpp's converter) name it; transformers 5 saves it one level up."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path)
    nest = "vision_tower.vision_model."
    save_file({(nest + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k): v
               for k, v in weights.items()}, path, metadata={"format": "pt"})


def _byte_level_tokenizer(folder: Path) -> None:
    """The tiny vocabulary, ids kept, as a byte-level BPE that llama.cpp's converter and runtime read:
    one token per ASCII character, newline runs cut into tokens of up to four (the character tokenizer's).
    The converter keeps as many embedding rows as the tokenizer counts (vocabulary plus added tokens,
    the specials in both): unused tokens make that the model's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = bytes_to_unicode()
    vocab = {t if t in SPECIALS else "".join(byte[b] for b in t.encode()): i for t, i in VOCAB.items()}
    vocab |= {f"<unused{i}>": i for i in range(len(VOCAB), VOCAB_SIZE - len(SPECIALS))}
    nl = byte[10]
    # merge order: a run of n newlines becomes fours, then the rest, as the character tokenizer cuts it
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(nl, nl), (nl * 2, nl * 2), (nl * 2, nl)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(folder))


@cache
def gguf_files() -> tuple[Path, Path]:
    """(tiny.gguf, mmproj-tiny.gguf): the checkpoint through llama.cpp's converter, in f32."""
    source = _DIR / "convert-input"
    shutil.copytree(hf_folder(), source)
    _released_names(source / "model.safetensors")
    _byte_level_tokenizer(source)
    out = _DIR / "gguf"
    out.mkdir()
    model, mmproj = out / "tiny.gguf", out / "mmproj-tiny.gguf"
    convert(source, model)
    convert(source, mmproj, args=("--mmproj",))
    return model, mmproj


@cache
def llama() -> LlamaCppRunner:
    r = LlamaCppRunner(gguf_files()[0], LlamaCppOptions(n_ctx=512, max_seqs=4, n_threads=2, mmproj="auto"))
    assert r.vision is not None, "the sibling mmproj-tiny.gguf was not picked up"
    return r


@cache
def torch_runner() -> Runner:
    r = load_torch_runner(load_model(hf_folder()), kv_tokens=512, block_size=BLOCK)
    assert r.vision is not None
    return r


def prompt_ids(text: str) -> list[int]:
    return load_tokenizer(hf_folder()).encode(text, add_special_tokens=False)


def expanded(prompt: str, image: Image) -> tuple[list[int], ImageSpan]:
    vision = torch_runner().vision
    assert vision is not None
    tokens, spans = vision.expand(prompt_ids(prompt), [image])
    return tokens, spans[0]


def prefill(r: Runner, tokens: list[int], span: ImageSpan, *, bidirectional: bool = True, seq: int = 0) -> np.ndarray:
    """Logits of every position [len(tokens), V], the image's features (the runner's own) over its span."""
    assert r.vision is not None
    features = r.vision.encode(span.image)
    picture = ChunkImage(span.start, features, bidirectional)
    table = list(range(-(-len(tokens) // BLOCK)))
    try:
        return r.step(StepBatch([SeqChunk(seq, tokens, 0, table, LogitsWanted.ALL, images=[picture])])).copy()
    finally:
        r.release(seq)


def kl_after(ref: np.ndarray, got: np.ndarray, span: ImageSpan) -> np.ndarray:
    """KL(ref || got) of each next-token distribution from the image's end on."""
    p, q = (torch.log_softmax(torch.from_numpy(x[span.end :]).double(), -1) for x in (ref, got))
    return (p.exp() * (p - q)).sum(-1).numpy()


def test_features_match_the_torch_tower() -> None:
    """mtmd's encoding of the image against twinfer's SigLIP + projector on the checkpoint (llama.cpp's
    converter stores the projection in f16)."""
    image = Image(random_pixels(1, 40, 30))  # resized to the tower's 32 x 32 by both
    vision = torch_runner().vision
    llama_vision = llama().vision
    assert vision is not None and llama_vision is not None
    ref = np.asarray(vision.encode(image).detach().cpu().float().numpy())
    got = llama_vision.encode(image)
    assert got.shape == ref.shape == (16, 64)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"gguf vision features: max |d| / max |ref| = {err:.2e}")
    assert err <= 1e-2


def test_kl_after_the_image_against_the_torch_graph() -> None:
    image = Image(random_pixels(1, 40, 30))
    tokens, span = expanded(IMAGE_PROMPT, image)
    ref, got = prefill(torch_runner(), tokens, span), prefill(llama(), tokens, span)
    kl = kl_after(ref, got, span)
    causal = kl_after(ref, prefill(llama(), tokens, span, bidirectional=False), span)
    print(f"gguf vision: mean KL after the image {kl.mean():.2e} (max {kl.max():.2e}) over {len(kl)} positions; "
          f"causal inside the image {causal.mean():.2e}")
    assert len(kl) >= 40 and kl.mean() <= KL_LIMIT
    assert causal.mean() > 10 * kl.mean()  # the non-causal image batch is what brings it close


def test_images_move_llamacpp_logits_and_repeat_exactly() -> None:
    a, b = Image(random_pixels(1, 40, 30)), Image(random_pixels(2, 40, 30))
    tokens, span_a = expanded(IMAGE_PROMPT, a)
    span_b = ImageSpan(span_a.start, span_a.length, b)
    first, again, other = prefill(llama(), tokens, span_a), prefill(llama(), tokens, span_a), prefill(llama(), tokens, span_b)
    assert np.array_equal(first, again)
    assert np.array_equal(first[: span_a.start], other[: span_a.start])  # text before the image: untouched
    assert float(np.abs(first[span_a.end :] - other[span_a.end :]).max()) > 0.05


@pytest.mark.parametrize("beside", [False, True])
def test_chunked_prefill_gives_the_same_rows(beside: bool) -> None:
    """The image in a later chunk (ids, then embeddings, then ids: three llama_decode calls) gives each
    position the logits of one chunk alone, exactly; with another sequence's text in the first step,
    within what llama.cpp's multi-sequence batches move text rows by too."""
    r = llama()
    image = Image(random_pixels(3, 32, 32))
    tokens, span = expanded(IMAGE_PROMPT, image)
    alone = prefill(r, tokens, span)
    text = prompt_ids(TEXT_PROMPT) if beside else []
    picture = ChunkImage(span.start - SPLIT, r.vision.encode(image) if r.vision is not None else None, True)
    try:
        others = [SeqChunk(1, text, 0, logits=LogitsWanted.NONE)] if text else []
        first = r.step(StepBatch([*others, SeqChunk(2, tokens[:SPLIT], 0, logits=LogitsWanted.ALL)]))
        rest = r.step(StepBatch([SeqChunk(2, tokens[SPLIT:], SPLIT, logits=LogitsWanted.ALL, images=[picture])]))
    finally:
        r.release(1)
        r.release(2)
    rows = np.concatenate([first, rest])
    if not beside:
        assert np.array_equal(rows, alone)
    else:
        assert float(np.abs(rows - alone).max()) <= 2e-3


@pytest.mark.parametrize("prompt", [
    "<bos>hi <start_of_image> there",
    "<bos>a\n<start_of_image>\nb",
    "<bos>x\n\n<start_of_image>\n\n\ny<start_of_image><start_of_image>z\n",
])  # fmt: skip
def test_expansion_matches_the_torch_tower(prompt: str) -> None:
    """The placeholder run (as many rows as mtmd makes) and the newline runs around it."""
    images = [Image(random_pixels(i, 32, 32)) for i in range(prompt.count("<start_of_image>"))]
    vision, llama_vision = torch_runner().vision, llama().vision
    assert vision is not None and llama_vision is not None
    ours = llama_vision.expand(prompt_ids(prompt), images)
    assert ours == vision.expand(prompt_ids(prompt), images)
    assert all(ours[0][s.start - 1] == BOI for s in ours[1])
    with pytest.raises(ValueError, match="image markers"):
        llama_vision.expand(prompt_ids(prompt), [])


def test_engine_request_with_an_image() -> None:
    """A request through the engine (expansion, encoding, chunking) decodes what the manual steps decode."""
    r = llama()
    image = Image(random_pixels(4, 32, 32))
    tokens, span = expanded(IMAGE_PROMPT, image)
    table = list(range(16))
    picture = ChunkImage(span.start, r.vision.encode(image) if r.vision is not None else None, True)
    try:
        rows = r.step(StepBatch([SeqChunk(0, tokens, 0, table, images=[picture])]))
        want = [int(rows[-1].argmax())]
        for _ in range(3):
            rows = r.step(StepBatch([SeqChunk(0, want[-1:], len(tokens) + len(want) - 1, table)]))
            want.append(int(rows[-1].argmax()))
    finally:
        r.release(0)
    engine = Engine(r, load_tokenizer(hf_folder()), EngineConfig(max_seqs=2, max_context=256, max_batch_tokens=32))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, guard=GuardConfig(enabled=False))
    engine.add_request(prompt_ids(IMAGE_PROMPT), greedy, images=[image])
    outputs = [o for _ in range(50) if engine.has_work for o in engine.step()]
    engine.close()
    assert [t for o in outputs for t in o.token_ids] == want and outputs[-1].image_tokens == span.length


def test_projector_options(tmp_path: Path) -> None:
    """"auto" takes the one sibling mmproj*.gguf, "off" none, a path that one; a missing one is an error."""
    from twinfer.backends.llamacpp.vision import projector_path
    from twinfer.runtime.errors import ModelError

    model, mmproj = gguf_files()
    assert projector_path(model, "auto", 64) == mmproj
    assert projector_path(model, "auto", 128) is None  # another model's width
    assert projector_path(model, "off", 64) is None
    assert projector_path(tmp_path / "m.gguf", "auto", 64) is None
    assert projector_path(model, str(mmproj), 64) == mmproj
    with pytest.raises(ModelError, match="not found"):
        projector_path(model, str(tmp_path / "nope.gguf"), 64)
    r = LlamaCppRunner(model, LlamaCppOptions(n_ctx=64, max_seqs=1, n_threads=1, mmproj="off"))
    try:
        assert r.vision is None and r.describe()["mmproj"] is None
    finally:
        r.close()


def test_sessions_take_the_projector_beside_the_model() -> None:
    """`--mmproj` reaches the runner through OpenOptions: auto (the default) finds the sibling, off and a
    path do what they say; a missing file, or one for a Hugging Face checkpoint, is refused before loading."""
    from twinfer.app import OpenOptions, open_session
    from twinfer.runtime.errors import OptionError

    model, mmproj = gguf_files()
    for given, expected in (("auto", mmproj), ("off", None), (str(mmproj), mmproj)):
        session = open_session(OpenOptions(str(model), "llamacpp", ctx=64, threads=1, mmproj=given))
        try:
            vision = session.opened.runner.vision
            assert (vision.path if isinstance(vision, LlamaCppVision) else None) == expected
        finally:
            session.close()
    with pytest.raises(OptionError, match="--mmproj: no file"):
        OpenOptions(str(model), mmproj=str(model.parent / "missing.gguf"))
    with pytest.raises(OptionError, match="a Hugging Face checkpoint carries its vision tower"):
        open_session(OpenOptions(str(hf_folder()), "torch", mmproj=str(mmproj)))


def test_image_rows_llamacpp_cannot_take_are_refused() -> None:
    """Features of another width, and a bidirectional image longer than one ubatch (its rows would not see
    each other), fail before anything is decoded."""
    r = LlamaCppRunner(gguf_files()[0], LlamaCppOptions(n_ctx=64, max_seqs=1, n_threads=1, n_batch=8, n_ubatch=8))
    try:
        tokens = [2, *[8] * 16, 20]
        for features, message in ((np.zeros((16, 32), np.float32), "not \\[rows, 64\\]"),
                                  (np.zeros((16, 64), np.float32), "one llama.cpp batch holds 8")):
            with pytest.raises(ValueError, match=message):
                r.step(StepBatch([SeqChunk(0, tokens, 0, images=[ChunkImage(1, features, True)])]))
        assert r.num_stored(0) == 0
        causal = ChunkImage(1, np.zeros((16, 64), np.float32), False)  # causal rows may span ubatches
        assert r.step(StepBatch([SeqChunk(0, tokens, 0, images=[causal])])).shape == (1, VOCAB_SIZE)
    finally:
        r.close()
