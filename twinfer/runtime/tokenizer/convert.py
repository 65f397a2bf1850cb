"""Build a Hugging Face `tokenizers` tokenizer that reproduces llama.cpp's tokenizer for a GGUF vocabulary:
"llama" (SentencePiece: BPE with merges derived from scores, byte fallback) and "gpt2" (byte-level BPE,
pre-tokenizer by `tokenizer.ggml.pre`), mirroring `llama-vocab.cpp` (docs/internals.md, "Tokenizers")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from twinfer.runtime.errors import ModelError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end-of-generation (and forces to CONTROL), from llama-vocab.cpp.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})  # fmt: skip
# Special tokens llama.cpp finds by text when the file gives no id (tokenizer.ggml.<name>_token_id);
# a token found this way becomes CONTROL, and fim_pad/fim_rep/fim_sep also end generation.
_FOUND_BY_TEXT: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _Pre((_QWEN2,))
_GPT2_PRE = _Pre((_GPT2,))
_STARCODER_PRE = _Pre((r"\p{N}", _GPT2))
# tokenizer.ggml.pre -> pre-tokenizer, for the byte-level BPE families llama.cpp and twinfer both support.
PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe", "chatglm-bpe"], _Pre((_LLAMA3,))),
    "glm4": _Pre((_LLAMA3,), ignore_merges=True),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "hunyuan", "solar-open"], _QWEN2_PRE),
    "qwen35": _Pre((_QWEN35,)),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling"], _GPT2_PRE),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"], _STARCODER_PRE
    ),
    "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "deepseek-coder": _Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-\ud7ff]+", r"\p{N}")),
}


@dataclass
class VocabInfo:
    """What the runtime needs besides the `tokenizers` JSON; stored next to it in the cache."""

    model: str  # "llama" or "gpt2"
    bos_id: int | None
    eos_id: int | None
    eog_ids: list[int]
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    architecture: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _opt_id(meta: dict[str, Any], key: str, default: int | None, n_vocab: int) -> int | None:
    value = meta.get(key, default)
    if value is None or not 0 <= int(value) < n_vocab:
        return default if default is not None and 0 <= default < n_vocab else None
    return int(value)


def _types_and_eog(
    meta: dict[str, Any], tokens: list[str], eos_id: int | None
) -> tuple[np.ndarray, list[int]]:
    """Token types after llama.cpp's text-based fixes (CONTROL on EOG-looking tokens), and its
    end-of-generation ids."""
    n = len(tokens)
    raw = meta.get("tokenizer.ggml.token_type")
    types = np.full(n, NORMAL, dtype=np.int32) if raw is None else np.array(raw, dtype=np.int32)
    index = {t: i for i, t in enumerate(tokens)}
    found: dict[str, int | None] = {}
    for name, texts in _FOUND_BY_TEXT.items():
        found[name] = _opt_id(meta, f"tokenizer.ggml.{name}_token_id", None, n)
        if found[name] is None:
            found[name] = next((index[t] for t in texts if t in index), None)
            if found[name] is not None:
                types[found[name]] = CONTROL
    eog_texts = set(EOG_TEXTS)
    if "<|tool_response>" in index or "<|plamo:eos|>" in index:
        eog_texts.discard("</s>")  # gemma4 and plamo have an ordinary "</s>"
    eog = {index[t] for t in eog_texts if t in index}
    types[sorted(eog)] = CONTROL
    eog |= {i for i in (eos_id, found["eot"], found["eom"], found["fim_pad"], found["fim_rep"], found["fim_sep"])
            if i is not None}  # fmt: skip
    return types, sorted(eog)


def vocab_info(meta: dict[str, Any]) -> VocabInfo:
    """Special ids and flags of a GGUF vocabulary, with llama.cpp's defaults."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    n = len(tokens)
    spm = model == "llama"
    bos = _opt_id(meta, "tokenizer.ggml.bos_token_id", 1 if spm else None, n)
    eos = _opt_id(meta, "tokenizer.ggml.eos_token_id", 2 if spm else None, n)
    pre = meta.get("tokenizer.ggml.pre", "default")
    default_bos = True if spm else PRE_TOKENIZERS.get(pre, _GPT2_PRE).add_bos
    return VocabInfo(
        model=str(model),
        bos_id=bos,
        eos_id=eos,
        eog_ids=_types_and_eog(meta, tokens, eos)[1],
        pad_id=_opt_id(meta, "tokenizer.ggml.padding_token_id", None, n),
        unk_id=_opt_id(meta, "tokenizer.ggml.unknown_token_id", 0 if spm else None, n),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        architecture=str(meta.get("general.architecture", "")),
    )


def build_from_gguf(meta: dict[str, Any], info: VocabInfo) -> HFTokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's tokenizer for the GGUF metadata `meta`."""
    model = meta.get("tokenizer.ggml.model")
    tokens = _clean_tokens(meta["tokenizer.ggml.tokens"])
    types, _ = _types_and_eog(meta, tokens, info.eos_id)
    if model == "llama":
        tok = _build_spm(meta, tokens)
    elif model == "gpt2":
        tok = _build_gpt2(meta, tokens)
    else:
        raise ModelError(
            f"GGUF tokenizer model {model!r} is not supported (twinfer supports 'llama' SentencePiece and "
            "'gpt2' byte-level BPE vocabularies); use the model's Hugging Face folder with tokenizer.json instead"
        )
    _add_special_tokens(tok, tokens, types)
    _set_post_processor(tok, tokens, info)
    return tok


def _clean_tokens(tokens: list[str]) -> list[str]:
    # llama.cpp renames empty tokens so that every text maps to one id.
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges that replay llama.cpp's score-driven SentencePiece merging: one merge per token (its
    last when tokenized alone), ranked by the produced token's score, longer left piece first on ties
    (docs/internals.md, "Tokenizers")."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = [float(s) for s in scores]
    found: list[tuple[float, int, int, str, str]] = []
    for text, i in vocab.items():
        if len(text) < 2 or " " in text:
            continue
        splits = [k for k in range(1, len(text)) if text[:k] in vocab and text[k:] in vocab]
        if len(splits) > 1:
            # llama.cpp may also merge characters that are not themselves tokens; BPE cannot express
            # that, but real vocabularies contain their characters.
            splits = [
                k for k in _last_spm_merge(text, vocab, score) if text[:k] in vocab and text[k:] in vocab
            ]
        if splits:
            k = splits[0]
            found.append((-score[i], -k, i, text[:k], text[k:]))
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]


def _last_spm_merge(text: str, vocab: dict[str, int], score: list[float]) -> list[int]:
    """[k] where llama.cpp's tokenization of `text` ends by merging text[:k] and text[k:], or []."""
    syms = list(text)
    while len(syms) > 1:
        best, best_score = -1, float("-inf")
        for j in range(len(syms) - 1):
            t = vocab.get(syms[j] + syms[j + 1])
            if t is not None and score[t] > best_score:  # strict: the leftmost pair wins ties
                best, best_score = j, score[t]
        if best < 0:
            return []
        if len(syms) == 2:
            return [len(syms[0])]
        syms[best : best + 2] = [syms[best] + syms[best + 1]]
    return []


def _build_spm(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores; reconvert the model")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = _opt_id(meta, "tokenizer.ggml.unknown_token_id", 0, len(tokens))
    bpe = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, np.asarray(scores, dtype=np.float32)),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(bpe)
    # llama.cpp escapes spaces as U+2581 and, with add_space_prefix, prepends one to every text fragment.
    replace = normalizers.Replace(" ", "▁")
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if add_prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _build_gpt2(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    pre_name = str(meta.get("tokenizer.ggml.pre", "default"))
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported yet; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges is None:
        raise ModelError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges; reconvert the model")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for m in raw_merges:
        pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if pos > 0:
            left, right = m[:pos], m[pos + 1 :]
            if left in vocab and right in vocab and left + right in vocab:
                merges.append((left, right))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_special_tokens(tok: HFTokenizer, tokens: list[str], types: np.ndarray) -> None:
    added = []
    for i in np.flatnonzero((types == CONTROL) | (types == UNKNOWN) | (types == USER_DEFINED)):
        special = int(types[i]) != USER_DEFINED
        added.append(AddedToken(tokens[i], special=special, normalized=False))
    tok.add_tokens(added)


def _set_post_processor(tok: HFTokenizer, tokens: list[str], info: VocabInfo) -> None:
    single, specials = "$A", []
    if info.add_bos and info.bos_id is not None:
        single = f"{tokens[info.bos_id]} {single}"
        specials.append((tokens[info.bos_id], info.bos_id))
    if info.add_eos and info.eos_id is not None:
        single = f"{single} {tokens[info.eos_id]}"
        specials.append((tokens[info.eos_id], info.eos_id))
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1", special_tokens=specials
        )
