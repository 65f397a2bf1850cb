"""`Tokenizer`: text <-> token ids for one model, backed by the Rust `tokenizers` library; built from a
GGUF file (converted once, cached) or a Hugging Face folder. Thread-safe."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from twinfer.runtime.errors import ModelError, RequestError
from twinfer.runtime.tokenizer.chat import builtin_template, render_chat


class Tokenizer:
    """Encodes and decodes text for one model; knows its special tokens and chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        source: str = "",
    ) -> None:
        self._tok = backend
        self._lock = threading.Lock()  # guards the backend's encode_special_tokens switch
        self.bos_id = bos_id
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self.eos_id = eos_id if eos_id is not None else (min(self.eos_ids) if self.eos_ids else None)
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source
        self._special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._byte_ids, self._byte_values = _byte_fallback_tokens(backend)
        self._single: dict[tuple[int, bool], str] = {}  # decode() of one id: at most two per vocabulary id


    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
        """Tokenizer of a GGUF file, ids matching llama.cpp's; the converted vocabulary is cached, and a
        built-in chat template fills in for known architectures."""
        from twinfer.runtime.tokenizer.cache import load_gguf_tokenizer

        backend, info = load_gguf_tokenizer(path, cache_dir)
        return cls(
            backend,
            bos_id=info.bos_id,
            eos_ids=info.eog_ids,
            eos_id=info.eos_id,
            pad_id=info.pad_id,
            add_bos=info.add_bos and info.bos_id is not None,
            chat_template=info.chat_template or builtin_template(info.architecture),
            source=str(path),
        )

    @classmethod
    def from_hf(cls, folder: str | Path) -> Tokenizer:
        """Tokenizer of a Hugging Face model folder (tokenizer.json, tokenizer_config.json, ...)."""
        root = Path(folder)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(
                f"{root} has no tokenizer.json; twinfer needs the fast-tokenizer file (save it with "
                "transformers: AutoTokenizer.from_pretrained(path).save_pretrained(path))"
            )
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception on a bad file
            raise ModelError(f"cannot load {tok_file}: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        bos_id = _special_id(backend, config.get("bos_token"))
        eos_id = _special_id(backend, config.get("eos_token"))
        eos_ids = {eos_id} if eos_id is not None else set()
        for name in ("generation_config.json", "config.json"):
            eos_ids |= _id_list(_read_json(root / name).get("eos_token_id"))
        _apply_add_bos_eos(backend, config, bos_id, eos_id)
        adds_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            eos_id=eos_id,
            pad_id=_special_id(backend, config.get("pad_token")),
            add_bos=adds_bos,
            chat_template=_hf_chat_template(root, config),
            source=str(root),
        )


    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens`: BOS/EOS where the model asks; `parse_special=False`
        encodes control-token text as plain text (untrusted content)."""
        with self._lock:
            if parse_special:
                return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
            self._tok.encode_special_tokens = True
            try:
                return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
            finally:
                self._tok.encode_special_tokens = False

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (`skip_special_tokens` drops control tokens); invalid UTF-8 becomes U+FFFD per
        maximal invalid subsequence, as Python and llama.cpp do."""
        if len(ids) == 1:  # the stream decoder's window after every emission: one token, kept per id
            key = (ids[0], skip_special_tokens)
            text = self._single.get(key)
            if text is None:
                text = self._single[key] = self._decode_ids(list(ids), skip_special_tokens)
            return text
        return self._decode_ids(list(ids), skip_special_tokens)

    def _decode_ids(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        if self._byte_values:
            ids = self._repair_byte_runs(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    def _repair_byte_runs(self, ids: list[int]) -> list[int]:
        # ByteFallback turns a whole invalid byte run into U+FFFDs; Python's replacement is the standard result
        values = self._byte_values
        if values.keys().isdisjoint(ids):
            return ids
        out: list[int] = []
        changed, i, n = False, 0, len(ids)
        while i < n:
            j = i
            while j < n and ids[j] in values:
                j += 1
            if j == i:
                out.append(ids[i])
                i += 1
                continue
            raw = bytes(values[t] for t in ids[i:j])
            try:
                raw.decode("utf-8")
                out += ids[i:j]
            except UnicodeDecodeError:
                out += [self._byte_ids[b] for b in raw.decode("utf-8", errors="replace").encode("utf-8")]
                changed = True
            i = j
        return out if changed else ids

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as stored (e.g. "▁the", "<0x0A>", "Ġthe")."""
        piece = self._tok.id_to_token(token_id) if 0 <= token_id < self._vocab_size else None
        if piece is None:
            raise RequestError(f"token id {token_id} is outside the vocabulary (0..{self._vocab_size - 1})")
        return piece

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._tok.token_to_id(piece)

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (BOS, EOS, <start_of_turn>, <unusedN>, ...): dropped by skip_special_tokens."""
        return token_id in self._special

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object underneath (structured output builds its token trie from it)."""
        return self._tok

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    @property
    def bos_token(self) -> str | None:
        return self._tok.id_to_token(self.bos_id) if self.bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tok.id_to_token(self.eos_id) if self.eos_id is not None else None


    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The model's chat template (or the documented fallback) rendered for `messages`."""
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat, with exactly one BOS where the model uses one."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={sorted(self.eos_ids)})"


def _byte_fallback_tokens(backend: HFTokenizer) -> tuple[list[int], dict[int, int]]:
    """Ids of the <0x00>..<0xFF> tokens and id -> byte, when the decoder turns them into bytes."""
    found = [backend.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    ids = [i for i in found if i is not None]
    if len(ids) != 256 or backend.decode([ids[0xC3], ids[0xA9]], skip_special_tokens=False) != "é":
        return [], {}
    return ids, {i: b for b, i in enumerate(ids)}




def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_id(backend: HFTokenizer, value: Any) -> int | None:
    text = _token_text(value)
    return backend.token_to_id(text) if text is not None else None


def _id_list(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _apply_add_bos_eos(
    backend: HFTokenizer, config: dict[str, Any], bos_id: int | None, eos_id: int | None
) -> None:
    """Honour explicit add_bos_token / add_eos_token the way transformers' Llama/Gemma tokenizers do."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    probe = backend.encode("", add_special_tokens=True).ids
    add_bos = bos_id is not None and bool(config.get("add_bos_token", probe[:1] == [bos_id]))
    add_eos = eos_id is not None and bool(config.get("add_eos_token", probe[-1:] == [eos_id]))
    specials = [
        (i, str(backend.id_to_token(i)))
        for i, on in ((bos_id, add_bos), (eos_id, add_eos))
        if on and i is not None
    ]
    if probe == [i for i, _ in specials]:
        return  # the post-processor already does what the config says
    bos = [specials[0][1]] if add_bos else []
    eos = [specials[-1][1]] if add_eos else []
    single = " ".join([*bos, "$A", *eos])
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=[(t, i) for i, t in dict(specials).items()]
    )


def _hf_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's chat_template."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = _read_json(root / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) else None
