"""The scheduler: which requests compute how many tokens this step.

It holds the waiting and running queues and the building blocks a step is made of: a running
request's next chunk, growing its blocks (a request that cannot get one preempts the least important
running one), admitting waiting requests from a cached prefix, and leftover room for drafts. Which
requests share the step is the batching policy's choice (batching.py: continuous or exact).
Nothing touches a device."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twinfer.runtime.engine.batching import Batching, ContinuousBatching, ExactBatching
from twinfer.runtime.engine.images import whole_image_chunk, whole_image_prefix
from twinfer.runtime.engine.request import Request, Status
from twinfer.runtime.kv.block_manager import BlockManager, OutOfBlocks

if TYPE_CHECKING:
    from twinfer.runtime.speculative.proposer import Draft


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512  # tokens computed per step (prefill chunks + decodes)
    max_seqs: int = 16  # requests running at once
    max_prefill_chunk: int = 512  # longest piece of one prompt computed in one step
    # exact (batch-invariant) batching, at most `invariant_rows` decode rows a step (batching.py)
    batch_invariant: bool = False
    invariant_rows: int = 7
    whole_images: bool = False  # never split an image across steps (its positions attend both ways)

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_seqs < 1 or self.max_prefill_chunk < 1:
            raise ValueError("scheduler limits must be positive")


@dataclass
class Scheduled:
    request: Request
    num_tokens: int
    admitted: bool = False  # first step of this request's (re)computation
    prefix_blocks: int = 0  # cached blocks it starts from (admitted requests only)
    draft_room: int = 0  # drafted tokens this decode may verify after its token (speculative decoding)
    external: int = 0  # prompt tokens whose KV a KV connector loads this step (num_tokens is then 0)
    draft: Draft | None = None  # the tokens drafted into `draft_room` (set by the engine's speculation)


@dataclass
class Schedule:
    items: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, n: int, admitted: bool = False) -> None:
        self.items.append(Scheduled(request, n, admitted=admitted))


class Scheduler:
    """Owns the waiting and running queues. Called by the engine once per step; `chunk`, `grow`, `start`,
    `admit` and `draft_room` are the building blocks its batching policy (batching.py) fills a step with."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 prefix_ok: Callable[[list[int]], int] | None = None,
                 draft_k: Callable[[Request], int] | None = None):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # prefix_ok(block_ids) -> how many of the matched blocks the runner can reuse (KVSync.reusable)
        self.prefix_ok = prefix_ok or len
        self.draft_k = draft_k  # draft_k(request) -> draft tokens its next decode would verify
        # external(request) -> prompt tokens a KV connector supplies (None: still on their way; skip it)
        self.external: Callable[[Request], int | None] | None = None
        self.preemptions = 0
        self.batching: Batching = (ExactBatching(config.invariant_rows) if config.batch_invariant
                                   else ContinuousBatching())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=Request.sort_key)

    def remove(self, request: Request) -> None:
        """Drop a request from the queues and free its blocks (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.seq_id)

    def schedule(self) -> Schedule:
        """This step's work: who computes how many tokens, who was preempted."""
        out = Schedule()
        self.running.sort(key=Request.sort_key)
        self.batching.fill(self, out)
        return out

    def start(self, request: Request) -> None:
        if not request.output:
            request.cached_tokens = request.num_computed
        request.status = Status.RUNNING
        if request.timings.scheduled is None:
            request.timings.scheduled = time.perf_counter()
        self.running.append(request)

    def draft_room(self, items: list[Scheduled], budget: int) -> int:
        """Give decodes room to verify drafts, within `budget` tokens and the free blocks."""
        for s in items:
            request = s.request
            if self.draft_k is None or budget <= 0:
                break
            if s.num_tokens != 1 or request.num_computed + 1 != request.num_tokens:
                continue  # not a decode: a prompt chunk, or a resumed request replaying its output
            k = min(self.draft_k(request), budget)
            if k <= 0:
                continue
            try:
                self.blocks.allocate(request.seq_id, [], request.num_tokens + k, request.tokens)
            except OutOfBlocks:
                continue
            s.draft_room = k
            budget -= k
        return budget

    def chunk(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed
        n = min(remaining, budget, self.config.max_prefill_chunk) if remaining > 1 else 1
        if request.params.prompt_logprobs is not None and request.num_computed < len(request.prompt):
            # scored prompts run in chunks at multiples of max_prefill_chunk, as a runner splits one
            # whole-window step (chunk shapes change a row's logits on some runners)
            n = min(n, self.config.max_prefill_chunk - request.num_computed % self.config.max_prefill_chunk)
        return self.fit_images(request, n, budget)

    def fit_images(self, request: Request, n: int, budget: int) -> int:
        """`n` tokens from the request's next position, cut so that no image is split (engine/images.py);
        0: the image that starts there does not fit `budget` this step."""
        if not self.config.whole_images or not request.images:
            return n
        return whole_image_chunk(request.images, request.num_computed, n, budget)

    def grow(self, request: Request, n: int, out: Schedule) -> bool:
        """Make room for n more tokens of a running request, preempting others if needed."""
        while True:
            try:
                self.blocks.allocate(request.seq_id, [], request.num_computed + n, request.tokens)
                return True
            except OutOfBlocks:
                victim = max(self.running, key=Request.sort_key)
                self._preempt(victim, out)
                if victim is request:
                    return False

    def _preempt(self, request: Request, out: Schedule) -> None:
        self.running.remove(request)
        self.blocks.free(request.seq_id)
        request.status = Status.WAITING
        request.num_computed = 0
        request.preemptions += 1
        self.preemptions += 1
        out.preempted.append(request)
        out.items = [s for s in out.items if s.request is not request]
        self.waiting.insert(0, request)

    def admit(self, budget: int, out: Schedule) -> int:
        skipped = 0  # waiting requests whose KV is still on its way from another replica
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.config.max_seqs:
            request = self.waiting[skipped]
            tokens = request.tokens
            external = self.external(request) if self.external is not None else 0
            if external is None:
                skipped += 1
                continue
            # a request scoring its prompt reads no cached prefix: cached rows carry no logits (vLLM skips
            # the lookup for prompt_logprobs too); its own blocks are still registered for others
            scored = request.params.prompt_logprobs is not None
            prefix = [] if external or scored else self.blocks.match_prefix(request.key_tokens)
            prefix = prefix[: self.prefix_ok(prefix)]
            if self.config.whole_images and request.images:
                prefix = prefix[: whole_image_prefix(request.images, len(prefix), self.blocks.block_size)]
            request.num_computed = len(prefix) * self.blocks.block_size
            n = 0 if external else min(len(tokens) - request.num_computed, budget, self.config.max_prefill_chunk)
            if not external and (n := self.fit_images(request, n, budget)) == 0:
                request.num_computed = 0
                break  # its next image needs a step with more room
            try:
                self.blocks.allocate(request.seq_id, prefix, request.num_computed + max(n, external), tokens)
            except OutOfBlocks:
                request.num_computed = 0
                break
            self.waiting.pop(skipped)
            self.start(request)
            out.items.append(Scheduled(request, n, admitted=True, prefix_blocks=len(prefix), external=external))
            budget -= max(n, 1)
        return budget
