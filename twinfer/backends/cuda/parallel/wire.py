"""A StepBatch as flat int64 tensors, so worker ranks receive step inputs rather than Python objects.
Message: a header [command, payload length] then the payload
[n_chunks, (seq_id, start, n_tokens, logits, n_blocks) per chunk, all tokens, all block tables]."""

from __future__ import annotations

import numpy as np
import torch

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch

STEP, STOP, RELEASE = 1, 2, 3  # RELEASE: the header's second field is the seq_id
_MODES = list(LogitsWanted)
_FIELDS = 5


def encode(batch: StepBatch) -> torch.Tensor:
    """The batch as one int64 tensor (see the module docstring for the layout)."""
    head = [len(batch.chunks)]
    for c in batch.chunks:
        head += [c.seq_id, c.start, len(c.tokens), _MODES.index(c.logits), len(c.block_table)]
    tokens = [t for c in batch.chunks for t in c.tokens]
    tables = [b for c in batch.chunks for b in c.block_table]
    return torch.from_numpy(np.asarray(head + tokens + tables, dtype=np.int64))


def decode(payload: torch.Tensor) -> StepBatch:
    """Inverse of `encode`."""
    a = payload.tolist()
    n = a[0]
    meta = [a[1 + i * _FIELDS : 1 + (i + 1) * _FIELDS] for i in range(n)]
    at = 1 + n * _FIELDS
    tokens_at, tables_at = at, at + sum(m[2] for m in meta)
    chunks = []
    for seq_id, start, ntok, mode, nblk in meta:
        chunks.append(SeqChunk(seq_id, a[tokens_at : tokens_at + ntok], start,
                               a[tables_at : tables_at + nblk], _MODES[mode]))
        tokens_at += ntok
        tables_at += nblk
    return StepBatch(chunks)
