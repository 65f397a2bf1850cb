"""Speculative decoding: proposers guess the next tokens, one target forward pass verifies them.

proposer.py     what a proposer is asked (DraftQuery) and answers (Draft)
ngram.py        prompt lookup over the request's own tokens
draft_model.py  a draft model with its own KV (`draft:PATH`), or the target with layers skipped (`self:N`)
accept.py       greedy and rejection-sampling verification (lossless)
adaptive.py     per-request draft length from the acceptance rate and the measured cost
speculator.py   the engine's side: room, drafts, verification, counters
options.py      `--speculate {off,ngram,draft:PATH,self:N}`
"""

from twinfer.runtime.speculative.draft_model import DraftModelProposer, SelfDraftProposer
from twinfer.runtime.speculative.ngram import NgramProposer
from twinfer.runtime.speculative.proposer import Draft, DraftQuery, Proposer
from twinfer.runtime.speculative.speculator import SpecConfig, Speculator

__all__ = ["Draft", "DraftModelProposer", "DraftQuery", "NgramProposer", "Proposer", "SelfDraftProposer",
           "SpecConfig", "Speculator"]
