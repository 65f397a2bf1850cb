"""`twinfer eval kl --candidate URL`: how faithfully an OpenAI-compatible endpoint serves a model.
The endpoint scores the reference's token stream through the completions API (prompt logprobs, or one
position per request); KL comes from its top k (quant/topk_kl.py), and the verdict weighs it against a
kernel floor (quant/allowance.py). Tokenizers must agree on the corpus first."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from twinfer.quant.allowance import (
    DEGRADED,
    FAITHFUL_KL,
    LLAMA_CPP_CPU,
    KernelFloor,
    kernels_line,
    other_kernels,
    verdict,
    verdict_line,
)
from twinfer.quant.fidelity import LogitSource, RunnerFactory, corpus_windows, open_source
from twinfer.quant.kl import KLReport, kl_rows
from twinfer.quant.topk_kl import BOUND, ESTIMATOR, TopRow, topk_estimate_rows
from twinfer.runtime.corpus import corpus_text
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.model_path import resolve_path

PROBE_BIAS = 100.0  # OpenAI's largest logit_bias: the probed token becomes the greedy choice


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


class PieceIndex:
    """Token pieces (as a server decodes one id) -> the ids that decode to each."""

    def __init__(self, tokenizer: Any):
        self.ids: dict[str, list[int]] = {}
        for i in range(tokenizer.vocab_size):
            self.ids.setdefault(tokenizer.decode([i]), []).append(i)

    def row(self, top: dict[str, float] | None) -> list[tuple[list[int], float]]:
        """An endpoint's `{piece: logprob}` as (ids, logprob) pairs; pieces outside the vocabulary keep no ids."""
        return [(self.ids.get(piece, []), float(lp)) for piece, lp in (top or {}).items()]


class Endpoint:
    """One OpenAI-compatible endpoint, through the `openai` SDK (its bounded, backed-off retries on 429/5xx)."""

    def __init__(self, url: str, api_key_env: str = "OPENAI_API_KEY", retries: int = 4, timeout_s: float = 60.0):
        try:
            import openai
        except ImportError as exc:
            raise TwinferError(f"--candidate URL needs the openai package (pip install openai): {exc}") from exc
        self.url = url.rstrip("/")
        self.retries = retries
        self._openai = openai
        key = os.environ.get(api_key_env) or "EMPTY"  # local servers take any key
        self.client = openai.OpenAI(base_url=self.url, api_key=key, max_retries=retries, timeout=timeout_s)
        self.model = self._call(self._served_model)
        self.system_fingerprint: str | None = None
        self.echo: bool | None = None  # whether it returns prompt logprobs; None until asked
        self.probe_kind: str | None = None  # "raw" or "biased" logprobs under logit_bias, "refused"; None until probed

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one SDK call; its failures become one-line `TwinferError`s that say what to do."""
        oa = self._openai
        try:
            return fn(*args, **kwargs)
        except oa.RateLimitError as exc:
            raise TwinferError(f"{self.url} answered 429 (rate limited) {self.retries + 1} times, with backed-off "
                               f"retries; wait and retry, or score fewer --tokens") from exc
        except oa.AuthenticationError as exc:
            raise TwinferError(f"{self.url} refused the API key (401): set it in the variable --api-key-env names "
                               "(default OPENAI_API_KEY)") from exc
        except oa.APITimeoutError as exc:
            raise TwinferError(f"{self.url} did not answer in time: {exc}") from exc
        except oa.APIConnectionError as exc:
            raise TwinferError(f"cannot reach {self.url}: {exc.__cause__ or exc}; is the server running, "
                               "and does the URL end in /v1?") from exc
        except oa.APIStatusError as exc:
            raise TwinferError(f"{self.url} answered {exc.status_code}: {_message(exc)}") from exc

    def _served_model(self) -> str:
        models = self.client.models.list().data
        if not models:
            raise TwinferError(f"{self.url}/models lists no model")
        return str(models[0].id)

    def complete(self, prompt: list[int], k: int) -> Any:
        """A greedy one-token completion of `prompt` (token ids) with top-k logprobs."""
        out = self._call(self.client.completions.create, model=self.model, prompt=prompt, max_tokens=1,
                         temperature=0.0, logprobs=k)
        self.system_fingerprint = getattr(out, "system_fingerprint", None) or self.system_fingerprint
        return out

    def probe(self, prompt: list[int], token: int, k: int, best: tuple[Sequence[int], float],
              pieces: PieceIndex) -> float | None:
        """The candidate's logprob of `token` after `prompt` by a `logit_bias` probe (the biased top-1
        `best` undoes a biased distribution's shift); None where the probe cannot be read."""
        out = self._call(self.client.completions.create, model=self.model, prompt=prompt, max_tokens=1,
                         temperature=0.0, logprobs=k, logit_bias={str(token): PROBE_BIAS})
        lp = getattr(out.choices[0], "logprobs", None)
        chosen = list(getattr(lp, "tokens", None) or [])
        values = list(getattr(lp, "token_logprobs", None) or [])
        tops = list(getattr(lp, "top_logprobs", None) or [])
        if not chosen or not values or token not in pieces.ids.get(chosen[0], []):
            self.probe_kind = "refused"
            return None
        top1 = next((v for ids, v in pieces.row(tops[0] if tops else None) if list(ids) == list(best[0])), None)
        if top1 is None:
            return None
        raw = abs(top1 - best[1]) < 1e-3
        self.probe_kind = "raw" if raw else "biased"
        return float(values[0]) if raw else float(values[0]) - PROBE_BIAS + best[1] - top1

    def prompt_logprobs(self, prompt: list[int], k: int) -> list[dict[str, float] | None] | None:
        """Top-k logprobs of every prompt position (`echo`), or None (and `echo` False) where it refuses."""
        def ask() -> Any:
            try:
                return self.client.completions.create(model=self.model, prompt=prompt, max_tokens=1,
                                                      temperature=0.0, logprobs=k, echo=True)
            except self._openai.BadRequestError:  # e.g. "echo with logprobs is not supported"
                return None

        out = self._call(ask)
        if out is None:
            self.echo = False
            return None
        lp = getattr(out.choices[0], "logprobs", None)
        tops = getattr(lp, "top_logprobs", None) if lp is not None else None
        if tops is None or len(tops) < len(prompt):
            self.echo = False
            return None
        self.echo = True
        self.system_fingerprint = getattr(out, "system_fingerprint", None) or self.system_fingerprint
        return list(tops)

    def tokenize(self, text: str) -> list[int] | None:
        """vLLM's `/tokenize` (at the server root) without special tokens; None where the endpoint has none."""
        import httpx

        root = self.url.removesuffix("/v1")
        try:
            r = httpx.post(f"{root}/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False},
                           headers={"Authorization": f"Bearer {self.client.api_key}"}, timeout=60.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        tokens = r.json().get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else None


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(getattr(exc, "message", exc))


@dataclass(frozen=True)
class RemoteKLReport:
    """`KLReport` of a reference against an endpoint, with what the endpoint said about itself."""

    kl: KLReport
    endpoint: str
    served_model: str
    system_fingerprint: str | None
    seconds: float
    method: str  # "echo" (prompt logprobs) or "token-by-token"
    top_k: int
    tokenizer_check: str
    candidate_tail_mass: float  # mean probability the endpoint left outside its top k
    bound: KLReport | None = None  # the tail-bucket lower bound on the same rows (`kl` is the estimate)
    sigma: float = 0.0  # RMS over rows of the fitted sigma of log q - log p
    probes: int = 0  # logit_bias probes answered (tokens outside the top k whose logprob was learnt)
    probe_kind: str | None = None  # how the endpoint answers them: "raw", "biased" or "refused"
    threshold: float = FAITHFUL_KL  # the most a faithful verdict allows (never above the floor's allowance)
    floor: KernelFloor = LLAMA_CPP_CPU  # what two faithful kernel paths of this model differ by
    kernels: str = ""  # which kernels the reference ran, against what `twinfer serve` runs

    @property
    def verdict(self) -> str:
        """faithful, within kernel noise, or degraded (quant/allowance.py)."""
        return verdict(self.kl.mean_kl, self.floor, self.threshold)

    @property
    def faithful(self) -> bool:
        """Not degraded: faithful or within kernel noise."""
        return self.verdict != DEGRADED

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        out = {**self.kl.as_dict(), **{k: v for k, v in d.items() if k not in ("kl", "bound")},
               "faithful": self.faithful, "verdict": self.verdict, "allowance": self.floor.allowance,
               "estimator": f"{ESTIMATOR}, k = {self.top_k}"}
        if self.bound is not None:
            out["bound"] = {**self.bound.as_dict(), "estimator": f"{BOUND}, k = {self.top_k}"}
        return out

    def lines(self) -> list[str]:
        return [
            *self.kl.lines(),
            f"  endpoint {self.endpoint}: model {self.served_model!r}, system_fingerprint {self.system_fingerprint}",
            f"  {self.method}, top-{self.top_k} logprobs; estimator: {ESTIMATOR} (sigma {self.sigma:.3f}); "
            f"candidate tail mass {self.candidate_tail_mass:.4f}; tokenizer checked by {self.tokenizer_check}",
            *([f"  lower bound ({BOUND}): mean KL {self.bound.mean_kl:.2e}"] if self.bound is not None else []),
            *([f"  {self.probes} logit_bias probes ({self.probe_kind} logprobs)"] if self.probe_kind else []),
            f"  {self.seconds:.1f} s",
            *([f"  {self.kernels}"] if self.kernels else []),
            f"  {self.floor.line()}",
            f"  {verdict_line(self.kl.mean_kl, self.floor, self.threshold)}",
        ]


def check_tokenizer(endpoint: Endpoint, tokenizer: Any, text: str) -> str:
    """Refuse an endpoint whose tokenizer splits `text` differently; returns how it was checked."""
    local = tokenizer.encode(text, add_special_tokens=False)
    remote = endpoint.tokenize(text)
    if remote is not None:
        if remote != local:
            i = next((j for j, (a, b) in enumerate(zip(local, remote, strict=False)) if a != b), min(len(local), len(remote)))
            theirs = remote[i] if i < len(remote) else "end"
            raise TwinferError(
                f"the endpoint's tokenizer disagrees with the model's on the corpus at token {i} "
                f"(local {local[i] if i < len(local) else 'end'}, endpoint {theirs}; {len(local)} vs {len(remote)} "
                "tokens): KL is only meaningful on the same tokens; serve the same model there")
        return "/tokenize"
    probe = text[:2000]
    out = endpoint._call(endpoint.client.completions.create, model=endpoint.model, prompt=probe, max_tokens=1,
                         temperature=0.0)
    expect = len(tokenizer.encode(probe, add_special_tokens=True))
    got = getattr(getattr(out, "usage", None), "prompt_tokens", None)
    if got != expect:
        raise TwinferError(f"the endpoint counts {got} prompt tokens in a corpus sample the model splits into "
                           f"{expect}: its tokenizer differs; serve the same model there")
    return "prompt token count"


def endpoint_rows(endpoint: Endpoint, tokens: list[int], k: int, pieces: PieceIndex) -> tuple[list[TopRow], str]:
    """The endpoint's top-k rows after each prefix tokens[:i+1], i < len(tokens) - 1, and the method used."""
    if endpoint.echo is not False:
        tops = endpoint.prompt_logprobs(tokens, k)
        if tops is not None:
            return [pieces.row(t) for t in tops[1 : len(tokens)]], "echo"
    rows: list[TopRow] = []
    for i in range(len(tokens) - 1):
        out = endpoint.complete(tokens[: i + 1], k)
        lp = getattr(out.choices[0], "logprobs", None)
        tops = getattr(lp, "top_logprobs", None) if lp is not None else None
        if not tops or tops[0] is None:
            raise TwinferError(f"{endpoint.url} returned no logprobs for a completion; eval kl needs an endpoint "
                               "that returns top logprobs (the completions API's `logprobs`)")
        rows.append(pieces.row(tops[0]))
    return rows, "token-by-token"


@dataclass(frozen=True)
class RemoteOptions:
    """How an endpoint is asked (`twinfer eval kl` with a URL candidate)."""

    top_k: int = 20  # top logprobs per position (OpenAI's limit: 20)
    api_key_env: str = "OPENAI_API_KEY"  # the variable holding the endpoint's key
    retries: int = 4
    threshold: float = FAITHFUL_KL  # mean KL at or below which the endpoint is judged faithful
    probes: int = 0  # logit_bias probes per position for the reference's likeliest tokens outside the top k
    probe_seconds: float = 60.0  # time limit on all probes

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= 20:
            raise TwinferError(f"--top-k must be in [1, 20] (OpenAI's limit on logprobs), got {self.top_k}",
                               field="top_k")
        if self.probes < 0 or self.probe_seconds < 0:
            raise TwinferError(f"--probes and --probe-seconds must be >= 0, got {self.probes} and "
                               f"{self.probe_seconds}", field="probes" if self.probes < 0 else "probe_seconds")


def measure_remote_kl(model: str | None, reference: str, url: str, corpus: str, tokens: int, window: int = 256, *,
                      runners: RunnerFactory, options: RemoteOptions | None = None) -> RemoteKLReport:
    """KL(reference || endpoint) over `tokens` corpus tokens, from the endpoint's top-k logprobs (plus up
    to `options.probes` logit_bias probes per position within `options.probe_seconds`)."""
    from twinfer.runtime.tokenizer import load_tokenizer

    o = options or RemoteOptions()
    top_k, probes = o.top_k, o.probes
    start = time.perf_counter()
    endpoint = Endpoint(url, o.api_key_env, o.retries)
    tokenizer = load_tokenizer(resolve_path(model))
    windows = list(corpus_windows(model, corpus, tokens, window))
    how = check_tokenizer(endpoint, tokenizer, _corpus_sample(corpus, tokens))
    pieces = PieceIndex(tokenizer)
    ref = open_source(reference, model, window, runners)
    other = other_kernels(reference)
    alt = open_source(other[0], model, window, runners) if other else None
    floors: list[np.ndarray] = []
    ests, bounds, agrees, tails, sigmas, method, n_probes = [], [], [], [], [], "", 0
    deadline = time.perf_counter() + o.probe_seconds
    for w in windows:
        if len(w) < 2:
            continue
        rows, method = endpoint_rows(endpoint, w, top_k, pieces)
        ref_logits = ref.logits(w)[:-1]
        if alt is not None:
            floors.append(_floor_rows(ref_logits, alt, w))
        probed = probe_rows(endpoint, w, rows, ref_logits, top_k, pieces, probes, deadline) if probes else None
        n_probes += sum(len(p) for p in probed or ())
        scored = topk_estimate_rows(ref_logits, rows, top_k, probed)
        ests.append(scored.estimate)
        bounds.append(scored.bucket)
        agrees.append(scored.agree)
        tails.append(scored.tail)
        sigmas.append(scored.sigma)
    report = _kl_report(reference, url, str(corpus), ests, agrees)
    bound = _kl_report(reference, url, str(corpus), bounds, agrees)
    return RemoteKLReport(
        kl=report, endpoint=url, served_model=endpoint.model, system_fingerprint=endpoint.system_fingerprint,
        seconds=time.perf_counter() - start, method=method, top_k=top_k, tokenizer_check=how,
        candidate_tail_mass=float(np.concatenate(tails).mean()), bound=bound,
        sigma=float(np.sqrt(np.mean(np.concatenate(sigmas) ** 2))), probes=n_probes,
        probe_kind=endpoint.probe_kind, threshold=o.threshold,
        floor=_floor(floors, other[1] if other else "", corpus), kernels=kernels_line(reference))


def _floor_rows(ref_logits: np.ndarray, other: LogitSource, tokens: list[int]) -> np.ndarray:
    return kl_rows(ref_logits, other.logits(tokens)[:-1])


def _floor(rows: Sequence[np.ndarray], what: str, corpus: str) -> KernelFloor:
    """The measured floor over the scored rows, or llama.cpp's declared one where none was measured."""
    if not rows:
        return LLAMA_CPP_CPU
    kl = np.concatenate(rows)
    return KernelFloor(float(kl.mean()), f"measured: {what}, on these {kl.size} tokens of {corpus}")


def probe_rows(endpoint: Endpoint, tokens: list[int], rows: Sequence[TopRow], ref_logits: np.ndarray, k: int,
               pieces: PieceIndex, per_row: int, deadline: float) -> list[list[tuple[int, float]]]:
    """Per row, (token, candidate logprob) of up to `per_row` of the reference's most likely tokens missing
    from the row, by `logit_bias` probes; stops at `deadline` (perf_counter) or where the endpoint refuses."""
    out: list[list[tuple[int, float]]] = [[] for _ in rows]
    for r, row in enumerate(rows):
        if not row:
            continue
        have = {int(i) for ids, _ in row for i in ids}
        best = max(row, key=lambda e: e[1])
        wanted = [int(t) for t in np.argsort(-ref_logits[r])[: per_row + len(have)] if int(t) not in have]
        for t in wanted[:per_row]:
            if time.perf_counter() > deadline or endpoint.probe_kind == "refused":
                return out
            lq = endpoint.probe(tokens[: r + 1], t, k, best, pieces)
            if lq is not None:
                out[r].append((t, lq))
    return out


def _corpus_sample(corpus: str, tokens: int) -> str:
    return corpus_text(corpus, max_chars=tokens * 12 + 10_000)[: tokens * 8]


def _kl_report(reference: str, candidate: str, corpus: str, kls: Sequence[np.ndarray],
               agrees: Sequence[np.ndarray]) -> KLReport:
    if not kls:
        raise TwinferError("no tokens were scored")
    kl, agree = np.concatenate(kls), np.concatenate(agrees)
    return KLReport(reference=reference, candidate=candidate, corpus=corpus, mean_kl=float(kl.mean()),
                    median_kl=float(np.median(kl)), p99_kl=float(np.percentile(kl, 99)), max_kl=float(kl.max()),
                    top1_agreement=float(agree.mean()), tokens=int(kl.size))
