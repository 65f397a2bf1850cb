"""The engine step's optional parts, as hooks it calls at fixed points instead of branching on them.

- `Speculation`: speculative decoding. `propose` after scheduling puts drafts on the scheduled decodes,
  `on_step` sees each forward pass's time, `accept` verifies a drafted decode, `release` forgets a
  finished request. `NoSpeculation` (no proposer) drafts nothing.
- `Handover`: KV hand-over between replicas through a `KVConnector` (runtime/kv/connector.py). `add`
  registers a request's transfer, `load` takes this step's admitted requests whose KV comes from
  another replica out of the batch, `idle` waits when nothing else could run, `finished` offers a
  finished prompt's KV. `NoHandover` (no connector) refuses requests that ask for a transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from twinfer.runtime.engine.sampler import draft_rows
from twinfer.runtime.errors import RequestError
from twinfer.runtime.kv.connector import KVConnector, KVTransferParams

if TYPE_CHECKING:
    import numpy as np

    from twinfer.runtime.engine.request import Request, RequestOutput
    from twinfer.runtime.engine.scheduler import Schedule, Scheduled
    from twinfer.runtime.kv.block_manager import BlockManager
    from twinfer.runtime.speculative.proposer import Draft
    from twinfer.runtime.speculative.speculator import Speculator


class NoSpeculation:
    """An engine without a proposer: every decode samples one token."""

    speculator: Speculator | None = None
    draft_k: Callable[[Request], int] | None = None  # the scheduler's: draft tokens a decode may verify

    def propose(self, items: list[Scheduled]) -> None:
        pass

    def on_step(self, seconds: float, items: list[Scheduled]) -> None:
        pass

    def accept(self, request: Request, draft: Draft, rows: np.ndarray) -> list[int]:
        raise AssertionError("no drafts without a proposer")

    def release(self, seq_id: int) -> None:
        pass


class Speculation(NoSpeculation):
    """Speculative decoding through one `Speculator` (runtime/speculative/speculator.py)."""

    def __init__(self, speculator: Speculator):
        self.spec = self.speculator = speculator
        self.draft_k = speculator.draft_k

    def propose(self, items: list[Scheduled]) -> None:
        drafts = self.spec.propose(items)
        for s in items:
            s.draft = drafts.get(s.request.seq_id)

    def on_step(self, seconds: float, items: list[Scheduled]) -> None:
        self.spec.on_step(seconds, items, {s.request.seq_id: s.draft for s in items if s.draft is not None})

    def accept(self, request: Request, draft: Draft, rows: np.ndarray) -> list[int]:
        """The tokens a drafted decode emits (the accepted drafts and one more), from its logits rows."""
        tokens = self.spec.accept(request, draft, draft_rows(rows, request.row, draft.tokens))
        request.bill.spec_proposed += len(draft.tokens)
        request.bill.spec_accepted += len(tokens) - 1
        return tokens

    def release(self, seq_id: int) -> None:
        self.spec.release(seq_id)


# on_loaded(request, tokens, nbytes, seconds) -> the request's first output, once its KV is in place
Loaded = Callable[["Request", int, float, float], "RequestOutput | None"]


class NoHandover:
    """An engine without a KV connector."""

    def add(self, request: Request) -> None:
        """Register a request before it is queued; refuse one asking for a transfer."""
        if KVTransferParams.parse(request.params.kv_transfer_params) is not None:
            raise RequestError("kv_transfer_params needs a replica started with a KV connector (--kv-connector)")

    def load(self, schedule: Schedule) -> list[RequestOutput]:
        return []

    def idle(self, loaded: list[RequestOutput]) -> None:
        pass

    def finished(self, request: Request, table: list[int]) -> None:
        pass


class Handover(NoHandover):
    """KV hand-over through `connector`. `on_loaded` records a loaded request's KV and emits the token the
    remote prefill sampled; `requeue` sends a request whose KV will not load back to recompute its prompt."""

    def __init__(self, connector: KVConnector, blocks: BlockManager, on_loaded: Loaded,
                 requeue: Callable[[Request], None]):
        self.connector = connector
        self.blocks = blocks
        self.on_loaded = on_loaded
        self.requeue = requeue

    def add(self, request: Request) -> None:
        transfer = KVTransferParams.parse(request.params.kv_transfer_params)
        if transfer is not None:
            self.connector.add_request(request, transfer)

    def external(self, request: Request) -> int | None:
        """The scheduler's: prompt tokens the connector supplies (None: still on their way)."""
        return self.connector.get_num_new_matched_tokens(request, request.num_computed)

    def load(self, schedule: Schedule) -> list[RequestOutput]:
        """Take the admitted requests whose KV a connector fetched out of the step and load it."""
        items = [s for s in schedule.items if s.external]
        if not items:
            return []
        schedule.items = [s for s in schedule.items if not s.external]
        for s in items:
            self.connector.update_state_after_alloc(s.request, self.blocks.table(s.request.seq_id), s.external)
        outputs: list[RequestOutput | None] = []

        def loaded(request: Request, tokens: int, nbytes: float, seconds: float) -> None:
            outputs.append(self.on_loaded(request, tokens, nbytes, seconds))

        for request in self.connector.start_load_kv(loaded):
            self.requeue(request)
        return [out for out in outputs if out is not None]

    def idle(self, loaded: list[RequestOutput]) -> None:
        if not loaded:
            self.connector.idle_wait()  # every waiting request's KV is still on its way

    def finished(self, request: Request, table: list[int]) -> None:
        _, request.kv_transfer_params = self.connector.request_finished(request, table)
