"""Images through the engine, with a fake vision tower over a tiny random llama on the torch runner.

The fake tower's "features" are token ids derived from the pixels, and the runner wrapper writes them over
the placeholder positions before the real forward pass: a request with an image must then produce exactly
what the text model produces for the prompt with those ids in place. Any bug in feature slicing, chunking,
prefix reuse across images or recomputation after preemption changes the greedy tokens.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np
import pytest
from fixtures_models import hf_canonical, hf_model, state_dict_np

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.images import image_key, key_tokens, whole_image_chunk, whole_image_prefix
from twinfer.runtime.errors import RequestError
from twinfer.runtime.runner import Runner
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision import Image, ImageSpan

torch = pytest.importorskip("torch")
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402

MARK, PAD, VOCAB = 95, 94, 96  # the image marker a "template" writes, and the placeholder it expands to
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, guard=GuardConfig(enabled=False))


class FakeTower:
    """Expands MARK into `length` PADs; an image's features are `length` token ids drawn from its digest."""

    def __init__(self, length: int = 12, bidirectional: bool = False):
        self.length = length
        self.bidirectional = bidirectional
        self.encoded: list[str] = []

    def expand(self, tokens: list[int], images: list[Image]) -> tuple[list[int], list[ImageSpan]]:
        if tokens.count(MARK) != len(images):
            raise ValueError(f"the prompt has {tokens.count(MARK)} image markers for {len(images)} images")
        out: list[int] = []
        spans: list[ImageSpan] = []
        pending = iter(images)
        for t in tokens:
            if t == MARK:
                spans.append(ImageSpan(len(out), self.length, next(pending)))
                out += [PAD] * self.length
            else:
                out.append(t)
        return out, spans

    def encode(self, image: Image) -> np.ndarray:
        self.encoded.append(image.digest)
        return self.ids(image)[:, None]

    def ids(self, image: Image) -> np.ndarray:
        return np.random.default_rng(int(image.digest[:8], 16)).integers(0, 90, self.length)

    def weight_bytes(self) -> int:
        return 0


class ImageRunner(Runner):
    """The torch runner with each chunk's image features written over their positions as token ids; it
    checks that a bidirectional image always arrives whole."""

    def __init__(self, inner: Runner, tower: FakeTower):
        self.inner, self.vision, self.tower = inner, tower, tower
        self.spec, self.kv, self.backend = inner.spec, inner.kv, inner.backend
        self.image_chunks: list[tuple[int, int, int]] = []  # (chunk length, offset, rows)

    def step(self, batch: StepBatch) -> np.ndarray:
        chunks = []
        for c in batch.chunks:
            tokens = list(c.tokens)
            for im in c.images:
                assert im.offset >= 0 and im.offset + im.rows <= len(tokens), "features outside the chunk"
                assert all(t == PAD for t in tokens[im.offset : im.offset + im.rows]), "features over text"
                if im.bidirectional:
                    assert im.rows == self.tower.length, "a bidirectional image was split across chunks"
                self.image_chunks.append((len(tokens), im.offset, im.rows))
                tokens[im.offset : im.offset + im.rows] = [int(t) for t in im.features[:, 0]]
            chunks.append(replace(c, tokens=tokens, images=[]))
        return self.inner.step(StepBatch(chunks, batch.exact))


@cache
def _tiny() -> tuple[ModelSpec, dict[str, np.ndarray]]:
    from twinfer.runtime.loaders.hf import spec_from_config

    model = hf_model("llama")
    return spec_from_config(model.config.to_dict()), hf_canonical(state_dict_np(model), "llama", tied=False)


def engine(tower: FakeTower | None = None, kv_tokens: int = 1024, **config: Any) -> Engine:
    spec, weights = _tiny()
    runner: Runner = build_torch_runner(spec, weights, kv_tokens=kv_tokens, block_size=4)
    if tower is not None:
        runner = ImageRunner(runner, tower)
    return Engine(runner, None, EngineConfig(**config))


def picture(seed: int) -> Image:
    return Image(np.random.default_rng(seed).integers(0, 256, (6, 5, 3), dtype=np.uint8))


def substituted(tower: FakeTower, prompt: list[int], images: list[Image]) -> list[int]:
    """The text prompt the image request must behave as: each marker replaced by the image's ids."""
    out: list[int] = []
    pending = iter(images)
    for t in prompt:
        out += [int(i) for i in tower.ids(next(pending))] if t == MARK else [t]
    return out


@cache
def reference(prompt: tuple[int, ...], max_tokens: int = 8) -> tuple[int, ...]:
    params = replace(GREEDY, max_tokens=max_tokens)
    return tuple(engine().generate([list(prompt)], params)[0].token_ids)


def run(e: Engine, prompt: list[int], images: list[Image], params: SamplingParams = GREEDY) -> Any:
    rid = e.add_request(prompt, params, images=images)
    while e.has_work:
        e.step()
        e.blocks.check()
    return e.full_output(e.requests[rid])


TEXT = [5, 17, 29, 3, 41, 8, 60]
PROMPT = TEXT[:3] + [MARK] + TEXT[3:]  # the image at positions [3, 15)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("chunk", [512, 5])
def test_image_request_equals_its_features_as_text(bidirectional: bool, chunk: int) -> None:
    tower = FakeTower(bidirectional=bidirectional)
    e = engine(tower, max_prefill_chunk=chunk, max_batch_tokens=max(chunk, 12))
    out = run(e, PROMPT, [picture(1)])
    assert tuple(out.token_ids) == reference(tuple(substituted(tower, PROMPT, [picture(1)])))
    assert out.prompt_tokens == len(TEXT) + 12 and out.image_tokens == 12
    if chunk == 5:  # a non-bidirectional image is sliced over chunks; a bidirectional one comes whole
        rows = sorted(r for _, _, r in e.runner.image_chunks)  # type: ignore[attr-defined]
        assert rows == ([12] if bidirectional else [2, 5, 5])


def test_two_images_same_text_never_share_kv() -> None:
    tower = FakeTower()
    e = engine(tower)
    a = run(e, PROMPT, [picture(1)])
    b = run(e, PROMPT, [picture(2)])
    assert tuple(a.token_ids) == reference(tuple(substituted(tower, PROMPT, [picture(1)])))
    assert tuple(b.token_ids) == reference(tuple(substituted(tower, PROMPT, [picture(2)])))
    assert a.token_ids != b.token_ids
    assert b.cached_tokens == 0  # the only full block before the image holds [0, 4), which covers position 3
    again = run(e, PROMPT, [picture(1)])
    assert again.cached_tokens == (len(PROMPT) + 11 - 1) // 4 * 4 == 16
    assert again.token_ids == a.token_ids
    assert tower.encoded == [picture(1).digest, picture(2).digest]  # the repeat's features came from the cache


def test_two_images_in_one_prompt_and_swapped() -> None:
    tower = FakeTower(length=6)
    prompt = [7, 7, 7, 7, MARK, 9, 9, MARK, 11]
    e = engine(tower)
    ab = run(e, prompt, [picture(3), picture(4)])
    ba = run(e, prompt, [picture(4), picture(3)])
    assert ba.cached_tokens == 4  # the text block before the first image only
    for out, images in ((ab, [picture(3), picture(4)]), (ba, [picture(4), picture(3)])):
        assert tuple(out.token_ids) == reference(tuple(substituted(tower, prompt, images)))


def test_prefix_hit_ending_inside_a_bidirectional_image_backs_off() -> None:
    tower = FakeTower(bidirectional=True)
    e = engine(tower, max_prefill_chunk=8, max_batch_tokens=16)
    image = picture(5)
    first = run(e, PROMPT, [image])
    request = e.requests[first.request_id]
    blocks = e.blocks.match_prefix(request.key_tokens)
    assert len(blocks) == (len(PROMPT) + 11 + 8) // 4  # the prompt and the output
    e.blocks.uncache(blocks[2:])  # the cache now ends at position 8, inside the image [3, 15)
    again = run(e, PROMPT, [image])
    assert again.cached_tokens == 0  # backed off to the block holding the image's start
    assert again.token_ids == first.token_ids


def test_preemption_recomputes_image_features() -> None:
    tower = FakeTower(length=8)
    prompts = [[i + 1, i + 2, MARK, i + 3] * 2 for i in range(5)]
    images = [[picture(10 + i), picture(20 + i)] for i in range(5)]
    e = engine(tower, kv_tokens=4 * 16, max_batch_tokens=64, max_seqs=5)
    params = replace(GREEDY, max_tokens=12)
    ids = [e.add_request(p, params, images=im) for p, im in zip(prompts, images, strict=True)]
    while e.has_work:
        e.step()
        e.blocks.check()
    assert e.scheduler.preemptions > 0, "the pool was meant to force preemption"
    for rid, p, im in zip(ids, prompts, images, strict=True):
        assert tuple(e.requests[rid].output) == reference(tuple(substituted(tower, p, im)), 12)


def test_penalties_and_bill_with_images() -> None:
    tower = FakeTower()
    e = engine(tower)
    params = replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.5)  # read prompt ids, never key ids
    first = run(e, PROMPT, [picture(1)], params)
    second = run(e, PROMPT, [picture(1)], params)
    assert first.token_ids == second.token_ids
    assert first.cost["images"]["tokens"] == 12 and first.cost["images"]["encoder_ms"] > 0
    assert second.cost["images"]["encoder_ms"] == 0.0  # features from the cache
    assert "images" not in run(e, TEXT, []).cost


def test_refusals() -> None:
    with pytest.raises(RequestError, match="reads no images"):
        engine().add_request(PROMPT, GREEDY, images=[picture(1)])
    with pytest.raises(RequestError, match="1 image markers for 2 images"):
        engine(FakeTower()).add_request(PROMPT, GREEDY, images=[picture(1), picture(2)])
    with pytest.raises(RequestError, match="raise max_batch_tokens to at least 12"):
        engine(FakeTower(bidirectional=True), max_batch_tokens=8).add_request(PROMPT, GREEDY, images=[picture(1)])


def test_key_ids_and_boundaries() -> None:
    a, b = ImageSpan(3, 12, picture(1)), ImageSpan(20, 4, picture(2))
    keys = key_tokens(list(range(30)), [a, b], VOCAB)
    assert keys[:3] == [0, 1, 2] and keys[15:20] == list(range(15, 20))
    assert set(keys[3:15]) == {image_key(a, VOCAB)} and min(keys[3:15] + keys[20:24]) >= VOCAB
    assert image_key(a, VOCAB) != image_key(b, VOCAB) and max(keys) < 2**63
    assert whole_image_chunk([a, b], 0, 8, 100) == 3  # stops before the image
    assert whole_image_chunk([a, b], 3, 5, 100) == 12  # takes the image whole
    assert whole_image_chunk([a, b], 3, 5, 11) == 0  # ... or waits for room
    assert whole_image_chunk([a, b], 3, 18, 100) == 17  # ends before the second image
    assert whole_image_prefix([a, b], 2, 4) == 0 and whole_image_prefix([a, b], 4, 4) == 4
    assert whole_image_prefix([a, b], 5, 4) == 5  # 20: the second image starts there
    assert whole_image_prefix([ImageSpan(2, 4, a.image), ImageSpan(6, 4, b.image)], 2, 4) == 0  # two back-offs


# -- end to end: the tiny Gemma 3 vision checkpoint against transformers ------------------------------
IMAGE_CHAT = "<bos><start_of_turn>user\nLook:\n<start_of_image>what is it?<end_of_turn>\n<start_of_turn>model\n"


@cache
def gemma3_engine_parts() -> tuple[Any, Any]:
    import tempfile
    from pathlib import Path

    from vision_models import save_tiny_gemma3_vision

    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.tokenizer import load_tokenizer

    folder = save_tiny_gemma3_vision(Path(tempfile.mkdtemp(prefix="twinfer-images-")) / "gemma3-vision")
    runner = load_torch_runner(load_model(folder), kv_tokens=64 * 4, block_size=4)
    return runner, load_tokenizer(folder)


def transformers_greedy(tokens: list[int], pixels: np.ndarray, steps: int) -> list[int]:
    """transformers' greedy continuation (full forward per token; image tokens attend both ways)."""
    from vision_models import IMAGE_TOKEN, gemma3_pixel_values, tiny_gemma3_vision

    ids = torch.tensor([tokens])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = tiny_gemma3_vision()(input_ids=ids, pixel_values=gemma3_pixel_values(pixels),
                                          token_type_ids=(ids == IMAGE_TOKEN).long()).logits
            out.append(int(logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_gemma3_images_change_the_output_as_in_transformers_and_reuse_kv() -> None:
    from vision_models import random_pixels

    runner, tokenizer = gemma3_engine_parts()
    e = Engine(runner, tokenizer, EngineConfig(max_prefill_chunk=8, max_batch_tokens=32))
    prompt = tokenizer.encode(IMAGE_CHAT, add_special_tokens=False)
    pixels = {seed: random_pixels(seed, 40, 30) for seed in (1, 2)}
    outs = {seed: run(e, prompt, [Image(p)]) for seed, p in pixels.items()}
    expanded = e.requests[outs[1].request_id].prompt
    for seed, out in outs.items():
        assert out.token_ids == transformers_greedy(expanded, pixels[seed], len(out.token_ids))
    assert outs[1].token_ids != outs[2].token_ids  # transformers' differ too (checked above)
    assert outs[2].cached_tokens <= e.requests[outs[1].request_id].images[0].start  # text before the image only
    again = run(e, prompt, [Image(pixels[1].copy())])
    assert again.cached_tokens >= e.requests[outs[1].request_id].images[0].end  # the image's KV reused
    assert again.token_ids == outs[1].token_ids
