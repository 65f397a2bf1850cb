"""`--speculate`: build the proposer over an opened target model (the option is parsed in runtime)."""

from __future__ import annotations

from twinfer.app.models import OpenedModel, open_model
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.speculative.options import parse_speculate
from twinfer.runtime.speculative.proposer import Proposer

_PROBE = "def main(argv):\n    return {'key': [1, 2.5]}  # The quick brown fox."


def open_proposer(value: str, target: OpenedModel, *, max_seqs: int, ctx: int | None = None,
                  threads: int | None = None) -> Proposer | None:
    """The proposer `--speculate value` asks for over `target` (None: off); a draft model opens on the
    target's backend, sized alike, and must share its tokenizer."""
    from twinfer.runtime.speculative.draft_model import DraftModelProposer, SelfDraftProposer
    from twinfer.runtime.speculative.ngram import NgramProposer

    kind, arg = parse_speculate(value)
    if kind == "off":
        return None
    if kind == "ngram":
        return NgramProposer()
    if kind == "self":
        return SelfDraftProposer(target.runner, int(arg))
    draft = open_model(arg, target.runner.backend, max_seqs=max_seqs, ctx=ctx, threads=threads)
    check_same_tokenizer(target, draft, arg)
    return DraftModelProposer(draft.runner, target.runner.spec.vocab_size)


def check_same_tokenizer(target: OpenedModel, draft: OpenedModel, path: str) -> None:
    """Drafts are token ids: the draft must read and write the target's ids."""
    t_vocab, d_vocab = target.runner.spec.vocab_size, draft.runner.spec.vocab_size
    same = d_vocab >= t_vocab
    if same and target.tokenizer is not None and draft.tokenizer is not None:
        same = target.tokenizer.encode(_PROBE) == draft.tokenizer.encode(_PROBE)
    if not same:
        close = getattr(draft.runner, "close", None)
        if close is not None:
            close()
        raise TwinferError(
            f"draft model {path} does not share the target's tokenizer (vocabularies of {d_vocab} and "
            f"{t_vocab} tokens, or different encodings): pick a draft from the same model family"
        )
