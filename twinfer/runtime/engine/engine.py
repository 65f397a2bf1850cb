"""The engine: requests -> scheduler -> step -> sampler -> guard -> stream. Single-threaded; one `step()`
is the handful of calls in docs/architecture.md, "One engine step". `AsyncEngine` runs it on a thread."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.constraints.compile import Grammars
from twinfer.runtime.constraints.mask import guide_for
from twinfer.runtime.engine.batching import StepMode
from twinfer.runtime.engine.bill import charge_request, charge_step
from twinfer.runtime.engine.guard import LoopGuard, bounded_by_grammar, token_text
from twinfer.runtime.engine.hooks import Handover, NoHandover, NoSpeculation, Speculation
from twinfer.runtime.engine.images import FeatureCache, key_tokens
from twinfer.runtime.engine.metrics import EngineMetrics
from twinfer.runtime.engine.params import SamplingParams
from twinfer.runtime.engine.request import Request, RequestOutput, Status, TokenLogprob
from twinfer.runtime.engine.sampler import Sampled, prompt_logprobs, sample, with_logprobs
from twinfer.runtime.engine.scheduler import Schedule, Scheduled, Scheduler, SchedulerConfig
from twinfer.runtime.errors import RequestError, TwinferError
from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.kv.connector import KVConnector, KVTransferParams
from twinfer.runtime.runner import ExactShapes, Runner
from twinfer.runtime.speculative.proposer import Draft, Proposer
from twinfer.runtime.speculative.speculator import SpecConfig, Speculator
from twinfer.runtime.tokenizer.detok import StreamDecoder
from twinfer.runtime.vision import ChunkImage, Image, ImageSpan


@dataclass(frozen=True)
class EngineConfig:
    max_batch_tokens: int | None = None  # tokens computed per step; None: the runner's `step_tokens`
    max_seqs: int = 16
    max_prefill_chunk: int = 512
    enable_prefix_cache: bool = True
    max_context: int | None = None  # defaults to the model's window, capped by the KV capacity
    batch_invariant: bool = False  # exact batching on runners that declare ExactShapes (runtime/runner.py)
    keep_finished: int = 64  # finished requests left in `Engine.requests` for callers; older ones go
    spec: SpecConfig = field(default_factory=SpecConfig)  # used when the engine gets a proposer
    replica: str | None = None  # this replica's name in a cluster (the bill's route)
    image_cache: int = 16  # images whose encoded features stay for reuse (engine/images.py)


class Engine:
    """Owns the requests of one model; one thread only (or AsyncEngine). A `proposer` adds drafts."""

    def __init__(self, runner: Runner, tokenizer: Any = None, config: EngineConfig | None = None,
                 proposer: Proposer | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        kv = runner.kv
        self.mode = StepMode(runner.exact_shapes() if self.config.batch_invariant else None)
        shared_cells = kv.seq_tokens is None or kv.copies_prefix  # else per-sequence cells: no prefix reuse
        shared_cells = shared_cells and not kv.recurrent  # a recurrent state is never kept per prefix
        if proposer is not None and kv.recurrent and kv.state_rollback < self.config.spec.max_k:
            name = runner.spec.name or runner.spec.model_type
            raise TwinferError(  # the state after each drafted token must be kept to take rejected ones back
                f"{name} keeps a recurrent state per sequence (linear-attention layers), which the "
                f"{runner.backend} runner cannot take back past a rejected draft: speculative decoding is off "
                "for it; drop --speculate" if kv.state_rollback == 0 else
                f"{name} keeps a recurrent state per sequence, which the {runner.backend} runner takes back at "
                f"most {kv.state_rollback} drafted tokens: draft at most that many (max_k {self.config.spec.max_k})")
        prefix_cache = self.config.enable_prefix_cache and not self.mode.exact and shared_cells
        self.blocks = BlockManager(kv.num_blocks, kv.block_size, prefix_cache)
        slots = kv.max_seqs - self.mode.reserved_seqs  # sequences the runner holds for us
        self.kv_sync = runner.kv_sync(self.blocks, slots, lambda: len(self.scheduler.running))
        step_tokens = runner.step_tokens if self.config.max_batch_tokens is None else self.config.max_batch_tokens
        vision = runner.vision
        sched = SchedulerConfig(step_tokens, min(self.config.max_seqs, slots), self.config.max_prefill_chunk,
                                self.mode.exact, self.mode.decode_rows or SchedulerConfig.invariant_rows,
                                whole_images=vision is not None and vision.bidirectional)
        self.features = FeatureCache(vision, self.config.image_cache) if vision is not None else None
        window = runner.spec.max_position
        self.max_context = min(self.config.max_context or window, window, kv.max_seq_tokens)
        self.speculation = NoSpeculation() if proposer is None else Speculation(
            Speculator(proposer, self.config.spec, self.max_context, self.blocks))
        self.speculator = self.speculation.speculator  # its counters, for metrics and benchmarks
        self.handover = NoHandover()  # KV hand-over between replicas (attach_connector)
        self.scheduler = Scheduler(sched, self.blocks, prefix_ok=self.kv_sync.reusable,
                                   draft_k=self.speculation.draft_k)
        self.requests: dict[str, Request] = {}  # live requests, and the last `keep_finished` finished ones
        self._finished: deque[Request] = deque()
        self.metrics = EngineMetrics(speculator=self.speculator)
        self.guard = LoopGuard(token_text(tokenizer))
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.eos_ids: frozenset[int] = frozenset(getattr(tokenizer, "eos_ids", ()) or ())
        self.grammars = Grammars(tokenizer, runner.spec.vocab_size)  # structured output (runtime/constraints)

    # -- public API --------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, images: Sequence[Image] = ()) -> str:
        """Queue a prompt (text or token ids); returns its request id. `images` go, in order, where the
        prompt's image markers are (the model's `VisionTower.expand`)."""
        params = params or SamplingParams()
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        tokens, spans = self._expand(tokens, images)
        if not tokens:
            raise RequestError("the prompt is empty: give at least one token of text")
        if len(tokens) >= self.max_context:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens but the context window is {self.max_context}: shorten it"
            )
        vocab = self.runner.spec.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id or f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        new_decoder = None
        if self.tokenizer is not None:
            new_decoder = partial(StreamDecoder, self.tokenizer, True, tokens[-4:])
        guide = guide_for(self.grammars, params.constraint)
        keys = key_tokens(tokens, spans, vocab) if spans else None
        request = Request(request_id, next(self._seq_ids), tokens, params, priority, new_decoder, guide, spans, keys)
        request.bill.image_tokens = request.image_tokens
        self.handover.add(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.metrics.on_arrival()
        return request_id

    def _expand(self, tokens: list[int], images: Sequence[Image]) -> tuple[list[int], list[ImageSpan]]:
        """The prompt with each image marker expanded to the model's placeholder run, and the spans."""
        if not images:
            return tokens, []
        vision = self.runner.vision
        if vision is None:
            name = self.runner.spec.name or self.runner.spec.model_type
            raise RequestError(f"this model reads no images ({name} has no vision tower): send text only")
        try:
            tokens, spans = vision.expand(tokens, list(images))
        except ValueError as e:
            raise RequestError(str(e)) from e
        room = self.scheduler.config.max_batch_tokens
        longest = max((s.length for s in spans), default=0)
        if self.scheduler.config.whole_images and longest > room:
            raise RequestError(f"an image takes {longest} positions, which one step computes whole, but a step "
                               f"computes at most {room} tokens: raise max_batch_tokens to at least {longest}")
        return tokens, spans

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        return self._finish(request, "abort")

    def close(self) -> None:
        """Abort everything and release kept sequences; the runner and proposer stay usable."""
        for request_id in [r for r, req in self.requests.items() if not req.finished]:
            self.abort(request_id)
        self.kv_sync.close()

    def attach_connector(self, connector: KVConnector) -> None:
        """Hand prompts' KV to and take it from other replicas (runtime/kv/connector.py)."""
        handover = Handover(connector, self.blocks, self._loaded_remote, self._requeue)
        self.handover = handover
        self.scheduler.external = handover.external

    @property
    def exact(self) -> ExactShapes | None:
        """The runner's exact shapes when the engine batches exactly (batch-invariant), else None."""
        return self.mode.shapes

    @property
    def pad_lone_rows(self) -> bool:
        """Whether exact steps hand the runner lone rows to pad (it reserved sequences for that)."""
        return self.mode.reserved_seqs > 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the deltas of every request that produced output."""
        schedule = self.scheduler.schedule()
        self._begin_kv(schedule)
        loaded = self.handover.load(schedule)  # prompts whose KV another replica computed
        if not schedule.items:
            self.handover.idle(loaded)
            return loaded
        self.speculation.propose(schedule.items)
        batch = self._batch(schedule.items)
        logits = self._forward(batch, schedule.items)
        return loaded + self._sample_and_finish(schedule.items, batch, logits)

    def generate(self, prompts: Iterable[str | Sequence[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion together; one finished RequestOutput per prompt, in order."""
        requests = [self.requests[self.add_request(p, params)] for p in prompts]
        results: dict[str, RequestOutput] = {}
        while self.has_work:
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
        for request in requests:
            self._forget(request)
        return [self.full_output(r, results.get(r.request_id)) for r in requests]

    def full_output(self, request: Request, last: RequestOutput | None = None) -> RequestOutput:
        logprobs = list(request.logprobs) if request.params.logprobs is not None else None
        out = request.make_output(request.text, list(request.output), final=request.finished, logprobs=logprobs,
                                  prompt_logprobs=self._prompt_logprobs(request, again=True))
        out.metrics = request.timings.as_dict(len(request.output))
        out.cost = self.cost(request) if request.finished else None
        out.kv_transfer_params = request.kv_transfer_params
        return out

    # -- step internals ----------------------------------------------------------------------------
    def _begin_kv(self, schedule: Schedule) -> None:
        """Tell the runner's KV storage who was preempted and who starts from a cached prefix."""
        admitted = [(s.request.seq_id, s.prefix_blocks) for s in schedule.items if s.admitted]
        alone = len(self.scheduler.running) == 1 and len(schedule.items) == 1
        if alone and admitted and schedule.items[0].request.params.prompt_logprobs is not None:
            self.kv_sync.isolate()  # a scored prompt alone computes as on a fresh runner
        self.kv_sync.begin_step([r.seq_id for r in schedule.preempted], admitted)

    def _loaded_remote(self, request: Request, tokens: int, nbytes: float, seconds: float
                       ) -> RequestOutput | None:
        """A prompt's KV came from another replica: record it and emit the token its prefill sampled."""
        self._computed(request, tokens)
        request.cached_tokens = request.bill.cached_remote = tokens
        request.bill.kv_transferred += nbytes
        request.bill.kv_transfer_s += seconds
        first = KVTransferParams.parse(request.params.kv_transfer_params)
        return self._emit(request, [Sampled(t) for t in first.first_token_ids] if first else [])

    def _batch(self, items: list[Scheduled]) -> StepBatch:
        return StepBatch([self._chunk(s, s.draft) for s in items], exact=self.mode.exact)

    def _chunk(self, s: Scheduled, draft: Draft | None) -> SeqChunk:
        """The step's tokens of one request; a decode with a draft, or a prompt chunk whose rows are
        scored (prompt logprobs), asks for logits at every position."""
        request, start = s.request, s.request.num_computed
        tokens = request.tokens[start : start + s.num_tokens]
        if draft is not None:
            return SeqChunk(request.seq_id, tokens + draft.tokens, start, self.blocks.table(request.seq_id),
                            LogitsWanted.ALL)
        last = start + s.num_tokens == request.num_tokens
        wanted = LogitsWanted.LAST if last else LogitsWanted.NONE
        if request.wants_prompt_logprobs and start < len(request.prompt) - 1:
            wanted = LogitsWanted.ALL
        images = self._chunk_images(request, start, s.num_tokens) if request.images else []
        return SeqChunk(request.seq_id, tokens, start, self.blocks.table(request.seq_id), wanted, images)

    def _chunk_images(self, request: Request, start: int, n: int) -> list[ChunkImage]:
        """The image features chunk [start, start + n) covers, encoded now if not cached (the bill's time)."""
        assert self.features is not None, "a request with images on a runner without vision"
        images, seconds = self.features.chunk_images(request.images, start, n)
        request.bill.encoder_s += seconds
        return images

    def _forward(self, batch: StepBatch, items: list[Scheduled]) -> np.ndarray:
        started = time.perf_counter()
        logits = self.runner.step_borrowed(batch)  # read within this step, before the next runner call
        seconds = time.perf_counter() - started
        self.metrics.on_step(batch.num_tokens, seconds)
        self.speculation.on_step(seconds, items)
        self._charge(batch, items, seconds)
        return logits

    def _charge(self, batch: StepBatch, items: list[Scheduled], seconds: float) -> None:
        """Put the step on its requests' bills: bytes from the runner's accounting, prompt work, verify time."""
        for s in items:
            r = s.request
            charge_request(r.bill, len(r.prompt), r.num_computed, s.num_tokens, s.draft is not None, seconds)
        step = self.runner.step_bytes(batch)
        if step is not None:
            charge_step([s.request.bill for s in items], [len(c.tokens) for c in batch.chunks], step)

    def _sample_and_finish(self, items: list[Scheduled], batch: StepBatch, logits: np.ndarray
                           ) -> list[RequestOutput]:
        """Record the computed KV, pick each request's new tokens (verifying drafts), emit them."""
        new: list[tuple[Request, list[Sampled]]] = []
        plain: list[tuple[Request, int]] = []  # requests sampling one token, and their logits row
        row = 0
        for s, chunk in zip(items, batch.chunks, strict=True):
            request, draft = s.request, s.draft
            if draft is not None:
                new.append((request, self._verify(request, draft, logits[row : row + chunk.logit_rows])))
            else:
                if chunk.logits is LogitsWanted.ALL:
                    self._score_prompt(request, chunk.start, logits[row : row + chunk.logit_rows])
                self._computed(request, s.num_tokens)
                if request.num_computed == request.num_tokens:
                    plain.append((request, row + chunk.logit_rows - 1))
            row += chunk.logit_rows
        if plain:
            rows = [r for _, r in plain]
            picked = logits if rows == list(range(len(logits))) else logits[rows]  # a decode step: no copy
            results = sample(picked, [request.row for request, _ in plain])
            new += [(request, [result]) for (request, _), result in zip(plain, results, strict=True)]
        outputs = [self._emit(request, results) for request, results in new]
        return [out for out in outputs if out is not None]

    def _score_prompt(self, request: Request, start: int, rows: np.ndarray) -> None:
        """Reduce a prompt chunk's rows to the next prompt token's logprob and the top k, at once
        (never keeping [rows, vocab] past the step); rows already scored (a recompute) are skipped."""
        k = request.params.prompt_logprobs
        first, end = len(request.prompt_logprobs), min(start + len(rows), len(request.prompt) - 1)
        if k is None or first >= end or first < start:
            return
        scored = prompt_logprobs(rows[first - start : end - start], request.prompt[first + 1 : end + 1], k)
        request.prompt_logprobs += [TokenLogprob(s.token, s.logprob or 0.0, s.top, s.rank) for s in scored]

    def _prompt_logprobs(self, request: Request, again: bool = False) -> list[TokenLogprob] | None:
        """The prompt's logprobs for an output: once, on the request's first delta (`again`: every time)."""
        if request.params.prompt_logprobs is None or (request.prompt_logprobs_sent and not again):
            return None
        request.prompt_logprobs_sent = True
        return list(request.prompt_logprobs)

    def _verify(self, request: Request, draft: Draft, rows: np.ndarray) -> list[Sampled]:
        """The tokens a drafted decode emits. The KV of its last token and the accepted drafts stays;
        the rejected tail is overwritten from `num_computed` on (the runner drops it there)."""
        tokens = self.speculation.accept(request, draft, rows)
        if request.row.guide is not None:
            request.row.guide.advance(tokens)
        self._computed(request, len(tokens), tokens[:-1])
        return [with_logprobs(t, r, request.params.logprobs) for t, r in zip(tokens, rows, strict=False)]

    def _computed(self, request: Request, n: int, accepted: list[int] | None = None) -> None:
        """n more tokens are in KV: register their full blocks (`accepted`: drafts not yet in output)."""
        request.num_computed += n
        tokens = request.key_tokens + accepted if accepted else request.key_tokens
        self.blocks.mark_computed(request.seq_id, tokens, request.num_computed)
        self.kv_sync.computed(request.seq_id, request.num_computed)

    def _emit(self, request: Request, results: list[Sampled]) -> RequestOutput | None:
        """Append the step's new tokens one at a time (each meets the stop rules and the guard)."""
        if request.timings.first_token is None:
            request.timings.first_token = time.perf_counter()
        for result in results:
            request.output.append(result.token)
            request.row.output_counts[result.token] += 1
            if result.logprob is not None:
                request.logprobs.append(TokenLogprob(result.token, result.logprob, result.top))
            reason = self._advance(request, result.token)
            if reason == "retry":
                return self._retry(request)
            if reason is not None:
                return self._finish(request, reason)
        return self._delta(request)

    def _advance(self, request: Request, token: int) -> str | None:
        """Apply one new token: stop conditions, the loop guard, detokenization. Returns why the
        request ends ("stop", "loop", "length"), "retry" for a guard retry, or None to go on."""
        p = request.params
        self.metrics.generated_tokens += 1
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            request.output.pop()  # stop tokens are not part of the text
            return "stop"
        if self.guard.check(request.output, p.guard) and not bounded_by_grammar(request.row.guide):
            self.guard.trips += 1
            self.metrics.guard_trips += 1
            return "retry" if request.retries < p.guard.retries else "loop"
        if request.decoder is not None:
            request.text += request.decoder.push(token)
            if p.stop and self._cut_stop_string(request):
                return "stop"
        if request.row.guide is not None and request.row.guide.complete_at(len(request.output)):
            return "stop"  # the grammar is complete: only EOS could follow
        if len(request.output) >= p.max_tokens or request.num_tokens >= self.max_context:
            return "length"
        return None

    def _cut_stop_string(self, request: Request) -> bool:
        text = request.text
        window = max(len(s) for s in request.params.stop) + 16
        start = max(0, request.emitted - window)
        hits = [i for i in (text.find(s, start) for s in request.params.stop) if i >= 0]
        if hits:
            request.text = text[: min(hits)]
            return True
        return False

    def _delta(self, request: Request, final: bool = False) -> RequestOutput | None:
        if (request.params.guard.retries or request.params.final_only) and not final:
            return None  # a retry could replace the text, or the caller wants the end only
        hold = 0 if final or not request.params.stop else max(len(s) for s in request.params.stop) - 1
        end = max(request.emitted, len(request.text) - hold)
        text = request.text[request.emitted : end]
        tokens = request.output[request.emitted_tokens :]
        if not text and not tokens and not final:
            return None
        request.emitted, request.emitted_tokens = end, len(request.output)
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = request.logprobs[len(request.logprobs) - len(tokens) :] if tokens else []
        out = request.make_output(text, tokens, final=final, logprobs=logprobs,
                                  prompt_logprobs=self._prompt_logprobs(request))
        if final:
            out.metrics = request.timings.as_dict(len(request.output))
            out.cost = self.cost(request)
            out.kv_transfer_params = request.kv_transfer_params
        return out

    def cost(self, request: Request) -> dict[str, Any]:
        """The request's bill (engine/bill.py) as a response's `cost` object."""
        t = request.timings
        bill = request.bill
        bill.cached_device = request.cached_tokens - bill.cached_remote
        cost = bill.as_dict(t.arrival, t.scheduled, t.first_token, t.finished or time.perf_counter(),
                            len(request.prompt), len(request.output))
        cost["route"] = {"replica": self.config.replica, "overlap_tokens": bill.cached_device, **bill.extra}
        return cost

    def _retry(self, request: Request) -> RequestOutput | None:
        request.retries += 1
        self.metrics.guard_retries += 1
        seed = None if request.params.seed is None else request.params.seed + request.retries
        temperature = request.params.guard.retry_temperature if request.params.greedy else None
        request.reset_output(seed, temperature)
        self._requeue(request)
        return None

    def _requeue(self, request: Request) -> None:
        """Back to the waiting queue to compute from scratch (a guard retry, KV that would not load)."""
        self.scheduler.remove(request)
        self.kv_sync.dropped(request.seq_id)
        request.num_computed = 0
        request.status = Status.WAITING
        self.scheduler.add(request)

    def _finish(self, request: Request, reason: str) -> RequestOutput | None:
        if request.decoder is not None and reason != "abort":
            tail = request.decoder.flush()
            if tail and not request.params.stop:
                request.text += tail
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.timings.finished = time.perf_counter()
        table = list(self.blocks.seqs[request.seq_id].table) if request.seq_id in self.blocks.seqs else []
        self.handover.finished(request, table)
        self.scheduler.remove(request)
        self.speculation.release(request.seq_id)
        self.kv_sync.finished(request.seq_id, table)
        self.metrics.on_finish(request)
        self._finished.append(request)
        while len(self._finished) > self.config.keep_finished:
            self._forget(self._finished.popleft())
        return self._delta(request, final=True)

    def _forget(self, request: Request) -> None:
        """Drop a finished request from `requests` (unless its id now names a newer request)."""
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
