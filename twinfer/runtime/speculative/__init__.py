"""Speculative decoding: proposers (ngram, draft model, self-draft) guess the next tokens, one target
pass verifies them losslessly (accept.py); adaptive.py picks the draft length, speculator.py is the
engine's side, options.py parses `--speculate`."""

from twinfer.runtime.speculative.draft_model import DraftModelProposer, SelfDraftProposer
from twinfer.runtime.speculative.ngram import NgramProposer
from twinfer.runtime.speculative.proposer import Draft, DraftQuery, Proposer
from twinfer.runtime.speculative.speculator import SpecConfig, Speculator

__all__ = ["Draft", "DraftModelProposer", "DraftQuery", "NgramProposer", "Proposer", "SelfDraftProposer",
           "SpecConfig", "Speculator"]
