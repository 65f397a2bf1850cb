"""`Grammars`: constraints compiled for one model's tokenizer, cached by (kind, text). Thread-safe.
`AsyncEngine` compiles on a worker thread under `time_limit_s`, so the engine thread never waits; a
failure or time-out is cached as such. The llguidance tokenizer is built once, sized to the model's
logit rows (padded rows are never allowed)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from twinfer.runtime.constraints.spec import Constraint, GrammarError

DEFAULT_TIME_LIMIT_S = 5.0


@dataclass
class ConstraintStats:
    """Counters for /metrics: compiles, their seconds, and the mask work of the engine's steps."""

    compiles: int = 0
    compile_seconds: float = 0.0
    compile_failures: int = 0
    constrained_requests: int = 0
    mask_steps: int = 0
    mask_rows: int = 0
    mask_seconds: float = 0.0
    rejected_tokens: int = 0  # sampled tokens the matcher refused (a bug or an unmasked path)

    def snapshot(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Entry:
    template: Any = None  # an llguidance.LLMatcher in its start state, or None when compiling failed
    error: str | None = None
    seconds: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)


class Grammars:
    """Compiles and caches constraints for one tokenizer; hands out fresh matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 cache_size: int = 128):
        self.source = tokenizer
        self.vocab_size = vocab_size  # the model's logit rows
        self.time_limit_s = time_limit_s
        self.cache_size = cache_size
        self.stats = ConstraintStats()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._ll_tokenizer: Any = None
        self._executor: Any = None

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self.source, self.vocab_size)
            return self._ll_tokenizer

    def executor(self) -> Any:
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            return self._executor

    def compile(self, constraint: Constraint) -> Any:
        """The start-state matcher of `constraint` (shared: copy it before use); GrammarError if it
        does not compile or took longer than the time limit."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            entry = self._cache.get(key)
            owner = entry is None
            if entry is None:
                entry = self._cache[key] = _Entry()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            self._build(constraint, entry)
        elif not entry.ready.wait(self.time_limit_s):
            raise GrammarError(self.too_slow(constraint))
        if entry.error is not None:
            raise GrammarError(entry.error)
        return entry.template

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one request."""
        template = self.compile(constraint)
        with self._lock:
            return template.deep_copy()

    def _build(self, constraint: Constraint, entry: _Entry) -> None:
        import llguidance

        try:
            tokenizer = self.ll_tokenizer()  # built once per model (seconds for 262k tokens), not timed
        except GrammarError as e:
            entry.error = str(e)
            entry.ready.set()
            return
        started = time.perf_counter()
        try:
            grammar = constraint.grammar()
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                entry.error = f"the {constraint.kind} constraint does not compile: {matcher.get_error()}"
            else:
                matcher.compute_bitmask()  # builds the lexer: part of the compile, not of the first step
                if matcher.is_error():
                    entry.error = f"the {constraint.kind} constraint cannot start: {matcher.get_error()}"
                entry.template = matcher
        except GrammarError as e:
            entry.error = str(e)
        entry.seconds = time.perf_counter() - started
        if entry.error is None and entry.seconds > self.time_limit_s:
            entry.error, entry.template = self.too_slow(constraint), None
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += entry.seconds
            self.stats.compile_failures += entry.error is not None
        entry.ready.set()

    def too_slow(self, constraint: Constraint) -> str:
        return (f"the {constraint.kind} constraint took longer than {self.time_limit_s:g} s to compile; "
                "simplify it (fewer alternatives, smaller repetition counts)")


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """An llguidance tokenizer over `tokenizer` with `vocab_size` rows: llguidance reads the
    `tokenizers` backend itself when it knows its model and decoder, else the vocabulary is listed
    token by token (`_Vocab`)."""
    import llguidance

    eos = sorted(getattr(tokenizer, "eos_ids", ()) or ())
    n_vocab = max(vocab_size, int(tokenizer.vocab_size))
    backend = getattr(tokenizer, "backend", None)
    try:
        if backend is not None:
            try:
                return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos or None)
            except ValueError:
                pass  # a model or decoder llguidance does not read: list the vocabulary instead
        wrapper = llguidance.TokenizerWrapper(_Vocab(tokenizer, n_vocab))
        return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos or None)
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError on odd vocabularies
        raise GrammarError(f"structured output is not available for this tokenizer: {e}") from e


class _Vocab:
    """What llguidance.TokenizerWrapper reads: every token's bytes (control tokens as 0xFF + name,
    llguidance's convention), the special ids, and an encode function."""

    def __init__(self, tokenizer: Any, n_vocab: int):
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_id", None)
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        special = set(getattr(tokenizer, "special_ids", ()))
        self.special_token_ids = sorted(special)
        self.tokens = [self._bytes(i, special) for i in range(int(tokenizer.vocab_size))]
        self.tokens += [b""] * (n_vocab - len(self.tokens))

    def _bytes(self, i: int, special: set[int]) -> bytes:
        if i in special:
            return b"\xff" + str(self.tokenizer.id_to_piece(i)).encode()
        text: str = self.tokenizer.decode([i])
        return text.encode("utf-8", errors="surrogateescape")

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return list(self.tokenizer.encode(text, add_special_tokens=False, parse_special=False))
