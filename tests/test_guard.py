"""The token-loop guard: real text never trips it, loops do, within a stated number of tokens.

Token sequences come from the default model's tokenizer (Gemma 3, which writes numbers digit by
digit); the corpus sample and the loops are bench/guard_corpus.py's. End to end: the guard on the
llama.cpp runner, a grammar that bounds a repeated phrase, and the `repetition_guard` request field
on all four HTTP APIs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.guard import LoopGuard, bounded_by_grammar, token_text, unit_kind
from twinfer.runtime.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CFG = GuardConfig()


@cache
def tok():  # noqa: ANN201
    return load_tokenizer(None)


@cache
def guard() -> LoopGuard:
    return LoopGuard(token_text(tok()))


@cache
def corpus() -> ModuleType:
    spec = importlib.util.spec_from_file_location("guard_corpus", ROOT / "bench" / "guard_corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def ids(text: str) -> list[int]:
    return tok().encode(text, add_special_tokens=False, parse_special=False)


def first_trip(seq: list[int], cfg: GuardConfig = CFG, start: int = 1) -> int | None:
    """The output length at which the guard first cuts `seq` fed one token at a time."""
    return corpus().first_trip(guard(), seq, cfg, start)


# -- what must never trip -------------------------------------------------------------------------------
NUMBERS = ["Repeat exactly: 1000000", "1000000 and 2000000", '{"name": "Springfield", "population": 111111111}',
           json.dumps({"population": 10**40, "area": 0.000000000001, "zeros": [0] * 64}, indent=4),
           "0x" + "0" * 64, "1/7 = 0." + "142857" * 30, "A" * 1364 + "=="]


@pytest.mark.parametrize("text", NUMBERS)
def test_numbers_never_trip(text: str) -> None:
    seq = ids(text)
    assert len(seq) >= 5 and first_trip(seq) is None


def test_digits_are_single_tokens() -> None:
    """Why numbers need their own rule: the default tokenizer writes 1000000 as seven tokens."""
    assert [tok().decode([t]) for t in ids("1000000")] == list("1000000")


def test_corpus_sample_never_trips() -> None:
    """200 stdlib files (an even stride over the sorted list), the language reference and the generated
    numbers, tables and JSON, as a generation's output: not one cut."""
    c = corpus()
    docs = c.stdlib_docs(200) + c.prose_docs() + c.number_docs() + c.table_docs() + c.json_docs()
    tripped = [(name, n) for name, text in docs if (n := first_trip(ids(text))) is not None]
    assert len(docs) >= 300  # 200 + the reference's topics (79 on 3.11) + 32 generated
    assert tripped == []


# -- what must trip, and when ------------------------------------------------------------------------------
PREFIX = "The capital of France is"


def needed(unit: list[int], cfg: GuardConfig = CFG) -> int:
    """The stated length of a text loop: min_copies copies at least, then text_copies copies or
    text_chars characters, whichever comes first."""
    chars = len("".join(guard().text(t) for t in unit))
    return len(unit) * max(cfg.min_copies, min(cfg.text_copies, -(-cfg.text_chars // chars)))


@pytest.mark.parametrize("unit", [" yes", " the cat", " I think so", " The quick brown fox jumps over the lazy dog.",
                                  "我不知道。"])
def test_text_loops_trip_at_the_stated_length(unit: str) -> None:
    head, body = ids(PREFIX), ids(unit)
    seq = head + body * 300
    n = first_trip(seq, start=len(head) + 1)
    assert n is not None and n - len(head) == needed(body) <= 256
    loop = guard().find(seq, CFG, n)
    assert loop is not None and loop.kind == "text" and loop.period == len(body)
    assert needed(ids(" yes")) == CFG.text_copies == 64  # one word forever: cut after 64 tokens


def test_floods_trip_at_their_character_limits() -> None:
    head = ids(PREFIX)
    for unit, chars in [("\n", CFG.blank_chars), ("0", CFG.filler_chars), ("!", CFG.filler_chars)]:
        body = ids(unit)
        assert len(body) == 1 and len(tok().decode(body)) == 1
        n = first_trip(head + body * (chars + 10), start=len(head) + 1)
        assert n is not None and n - len(head) == chars, unit


def test_thresholds_and_switch() -> None:
    head = ids(PREFIX)
    seq = head + ids(" ok") * 80
    assert guard().check(seq, CFG)
    assert not guard().check(seq, GuardConfig(enabled=False))
    assert not guard().check(seq, GuardConfig(text_copies=81))
    assert first_trip(seq, GuardConfig(text_copies=8), len(head) + 1) == len(head) + 8
    assert first_trip(seq, GuardConfig(text_chars=30), len(head) + 1) == len(head) + 10


def test_unit_kinds() -> None:
    kinds = {" yes": "text", " the cat,": "text", "我是": "text", "false, ": "text", "0": "filler",
             "0x00, ": "filler", "\\xff": "filler", "AAAA": "filler", "/wAA": "filler", "| --- ": "filler",
             "───": "filler", "  \n": "blank", "\u2581": "blank"}
    assert {t: unit_kind(t) for t in kinds} == kinds


def test_token_text_keeps_sentencepiece_spaces() -> None:
    """A lone SentencePiece word piece decodes without its space in some decoders; the guard keeps it."""

    class Spm:
        def decode(self, ids: list[int]) -> str:
            return {1: "yes", 2: " "}[ids[0]]

        def id_to_piece(self, token: int) -> str:
            return {1: "\u2581yes", 2: "\u2581\u2581"}[token]

    text = token_text(Spm())
    assert (text(1), text(2)) == (" yes", "  ")
    assert token_text(None)(7) == " t7"


@pytest.mark.parametrize("bad", [dict(max_period=0), dict(min_copies=1), dict(text_copies=1), dict(retries=-1),
                                 dict(blank_chars=1)])
def test_bad_guard_config(bad: dict[str, int]) -> None:
    from twinfer.runtime.errors import RequestError

    with pytest.raises(RequestError):
        GuardConfig(**bad)


# -- grammars bound what they constrain -----------------------------------------------------------------------
def test_bounded_by_grammar() -> None:
    from twinfer.runtime.constraints.compile import Grammars
    from twinfer.runtime.constraints.mask import guide_for
    from twinfer.runtime.constraints.spec import Constraint

    grammars = Grammars(tok(), tok().vocab_size)
    schema = Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string"},
                                                                      "population": {"type": "integer"}}})

    def after(constraint: Constraint, text: str) -> bool:
        guide = guide_for(grammars, constraint)
        guide.advance(ids(text))
        assert guide.consumed == len(ids(text))
        return bounded_by_grammar(guide)

    assert after(schema, '{"name": "Springfield", "population": 111')  # a number: a dozen tokens allowed
    assert not after(schema, '{"name": "Spring')  # inside a string: free text
    assert after(Constraint("regex", "( yes){40}"), " yes yes")
    assert not after(Constraint("regex", "(.|\\n)*"), "anything")
    assert not bounded_by_grammar(None)


# -- end to end on the default model ----------------------------------------------------------------------------
def _opened() -> Any:
    from twinfer.app.models import open_model

    return open_model(None, "llamacpp", max_seqs=4, ctx=1024, threads=1)  # one thread: a shared 2-core host


@cache
def _engine() -> Engine:
    o = _opened()
    return Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=4))


LOOPY = "Repeat after me forever: yes yes yes yes yes yes yes yes yes yes yes yes yes"


def test_end_to_end_finish_reason_loop() -> None:
    e = _engine()
    out = e.generate([LOOPY], SamplingParams(max_tokens=96, temperature=0.0))[0]
    assert out.finish_reason == "loop", out.text
    assert len(out.token_ids) <= CFG.text_copies + 8  # the model says " yes" at once: cut at text_copies
    assert e.metrics.guard_trips >= 1
    off = e.generate([LOOPY], SamplingParams(max_tokens=32, temperature=0.0, guard=GuardConfig(enabled=False)))[0]
    assert off.finish_reason == "length" and len(off.token_ids) == 32


def test_grammar_bounded_repeats_are_not_cut() -> None:
    """A grammar that asks for " yes" 72 times gets it: the guard does not cut inside it."""
    from twinfer.runtime.constraints.spec import Constraint

    params = SamplingParams(max_tokens=96, temperature=0.0, constraint=Constraint("regex", "( yes){72}"))
    out = _engine().generate([LOOPY], params)[0]
    assert out.finish_reason == "stop" and out.text == " yes" * 72


def test_retry_with_fresh_seed() -> None:
    e = _engine()
    before = e.metrics.guard_retries
    params = SamplingParams(max_tokens=72, temperature=0.0, seed=7, guard=GuardConfig(retries=2))
    out = e.generate([LOOPY], params)[0]
    retried = e.metrics.guard_retries - before
    assert 1 <= retried <= 2
    # a retry either escaped the loop or gave up after the last one
    assert out.finish_reason in ("length", "stop") or (out.finish_reason == "loop" and retried == 2)
    assert e.blocks.num_used == 0


# -- the request field, on every API -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    from twinfer.runtime.engine.async_engine import AsyncEngine
    from twinfer.server import create_app
    from twinfer.server.serve import ServerThread

    o = _opened()  # a runner of its own: two engines never share one
    engine = AsyncEngine(Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=4, max_context=1024)))
    engine.start()
    st = ServerThread(create_app(engine, o.tokenizer, "m")).start()
    yield st.url
    st.call(engine.shutdown(drain=False))
    st.stop()


MAX = 24  # under the default's 64 copies: only a request's own thresholds cut this short
BODIES = {
    "/v1/chat/completions": lambda g: {"messages": [{"role": "user", "content": LOOPY}], **g},
    "/v1/completions": lambda g: {"prompt": LOOPY, **g},
    "/v1/responses": lambda g: {"input": LOOPY, **g},
    "/v1/messages": lambda g: {"messages": [{"role": "user", "content": LOOPY}], **g},
}


def _ask(url: str, route: str, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    cap = {"max_output_tokens": MAX} if route == "/v1/responses" else {"max_tokens": MAX}
    body = {"model": "m", "temperature": 0, **cap, **BODIES[route](fields)}
    r = httpx.post(url + route, json=body, timeout=120)
    return r.status_code, r.json()


def _finish(route: str, out: dict[str, Any]) -> tuple[str, int]:
    """(finish reason, output tokens) in each API's own words."""
    if route == "/v1/responses":
        return out["status"], out["usage"]["output_tokens"]
    if route == "/v1/messages":
        return out["stop_reason"], out["usage"]["output_tokens"]
    return out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]


@pytest.mark.parametrize("route", list(BODIES))
def test_repetition_guard_field(server: str, route: str) -> None:
    """Absent: the server's default, which lets 24 tokens of " yes" through; an object sets the
    thresholds (8 copies cut it); false turns the guard off; a bad field is a 400 that names it."""
    results = [_ask(server, route, f) for f in ({}, {"repetition_guard": {"text_copies": 8}},
                                                {"repetition_guard": False})]
    assert [code for code, _ in results] == [200, 200, 200]
    (reason, full), (cut_reason, cut), (_, off) = [_finish(route, out) for _, out in results]
    assert full == off == MAX and cut < 16
    if route in ("/v1/chat/completions", "/v1/completions"):
        assert (reason, cut_reason) == ("length", "loop")
    bad, err = _ask(server, route, {"repetition_guard": {"text_copys": 8}})
    assert bad == 400 and "text_copys" in json.dumps(err)
    bad, err = _ask(server, route, {"repetition_guard": {"min_copies": 1}})
    assert bad == 400 and "repetition_guard.min_copies must be at least 2" in json.dumps(err)


def test_ignore_eos_turns_the_guard_off_unless_asked(server: str) -> None:
    route = "/v1/completions"
    _, out = _ask(server, route, {"ignore_eos": True, "repetition_guard": {"text_copies": 8}})
    assert _finish(route, out)[0] == "loop"
    from twinfer.server.prompts import repetition_guard

    off = GuardConfig(enabled=False)
    assert repetition_guard(off, True) == GuardConfig()  # a request turns on a guard the server has off
    assert repetition_guard(off, {"text_chars": 99}) == GuardConfig(text_chars=99)
    assert repetition_guard(GuardConfig(), None) == GuardConfig()


def test_serve_flag() -> None:
    from typer.testing import CliRunner

    from twinfer.cli.main import app

    out = CliRunner().invoke(app, ["serve", "--repetition-guard", "maybe", "--port", "0"])
    assert out.exit_code != 0 and "--repetition-guard on or off" in str(out.exception)
