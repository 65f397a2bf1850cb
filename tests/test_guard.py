"""The token-loop guard on real token sequences of the default model, and end to end on llama.cpp."""

from __future__ import annotations

from functools import cache

import pytest

from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.guard import LoopGuard, is_exempt_text
from twinfer.runtime.tokenizer import load_tokenizer


@cache
def tok():  # noqa: ANN201
    return load_tokenizer(None)


def guard() -> LoopGuard:
    return LoopGuard(lambda t: tok().decode([t]))


def ids(text: str) -> list[int]:
    return tok().encode(text, add_special_tokens=False)


def test_repeated_word_is_cut_at_four() -> None:
    g, cfg = guard(), GuardConfig()
    seq = ids("I think ok ok ok ok")  # ' ok' four times in a row
    assert g.check(seq, cfg)
    assert not g.check(seq[:-1], cfg)  # three times is allowed
    assert not g.check(seq, GuardConfig(max_repeats=5))
    assert not g.check(seq, GuardConfig(enabled=False))


def test_tables_of_dashes_and_box_drawing_survive() -> None:
    g, cfg = guard(), GuardConfig()
    table = ids("| name | size |\n" + "| --- | --- |\n" * 3)
    dashes = [ids(" ---")[0]] * 12
    boxes = ids("│ ─── │") + [ids("──")[0]] * 8
    for seq in (table, dashes, boxes):
        assert not g.check(seq, cfg), tok().decode(seq)


def test_short_cycles_are_detected() -> None:
    g = guard()
    cycle = ids(" the cat sat")
    seq = ids("Once upon a time") + cycle * 4
    assert g.check(seq, GuardConfig(cycle_repeats=4))
    assert not g.check(seq, GuardConfig(cycle_repeats=5))
    assert not g.check(seq, GuardConfig(cycle_period=0))


def test_exempt_text() -> None:
    assert is_exempt_text("--- |") and is_exempt_text("  \n") and is_exempt_text("═══")
    assert not is_exempt_text("SSSS") and not is_exempt_text("😀")


@cache
def _engine() -> Engine:
    from twinfer.app.models import open_model

    opened = open_model(None, "llamacpp", max_seqs=4, ctx=1024)
    return Engine(opened.runner, opened.tokenizer, EngineConfig(max_seqs=4))


LOOPY = "Repeat after me forever: yes yes yes yes yes yes yes yes yes yes yes yes yes"


def test_end_to_end_finish_reason_loop() -> None:
    e = _engine()
    out = e.generate([LOOPY], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.finish_reason == "loop", out.text
    assert e.metrics.guard_trips >= 1
    off = e.generate([LOOPY], SamplingParams(max_tokens=24, temperature=0.0, guard=GuardConfig(enabled=False)))[0]
    assert off.finish_reason == "length" and len(off.token_ids) == 24


def test_retry_with_fresh_seed() -> None:
    e = _engine()
    before = e.metrics.guard_retries
    params = SamplingParams(max_tokens=32, temperature=0.0, seed=7, guard=GuardConfig(retries=2))
    out = e.generate([LOOPY], params)[0]
    retried = e.metrics.guard_retries - before
    assert 1 <= retried <= 2
    # a retry either escaped the loop or gave up after the last one
    assert out.finish_reason in ("length", "stop") or (out.finish_reason == "loop" and retried == 2)
    assert e.blocks.num_used == 0


@pytest.mark.parametrize("bad", [dict(max_repeats=1), dict(retries=-1), dict(cycle_repeats=1)])
def test_bad_guard_config(bad: dict[str, int]) -> None:
    from twinfer.runtime.errors import RequestError

    with pytest.raises(RequestError):
        GuardConfig(**bad)
