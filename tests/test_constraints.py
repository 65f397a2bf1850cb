"""Structured output in the engine: grammar masks per row, batched, on a deterministic fake model.

The model is a numpy "runner" whose logits depend only on (token, position) — a legal model the
engine cannot tell from a real one, fast enough for hundreds of hypothesis-generated JSON schemas.
Every constrained output must validate (jsonschema), unconstrained rows in the same batch must be
unchanged, padded vocabulary rows (Gemma 3's) are never allowed, and speculative decoding with
random drafts must give exactly the non-speculative constrained output.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from twinfer.runtime.batch import StepBatch  # noqa: E402
from twinfer.runtime.constraints import Constraint, GrammarError  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams  # noqa: E402
from twinfer.runtime.runner import KVLayout, Runner  # noqa: E402
from twinfer.runtime.spec import ModelSpec  # noqa: E402
from twinfer.runtime.speculative.proposer import Draft, DraftQuery, Proposer  # noqa: E402
from twinfer.runtime.tokenizer import Tokenizer  # noqa: E402

VOCAB = 102  # 97 characters + 5 specials
NO_GUARD = GuardConfig(enabled=False)


def char_tokenizer() -> Tokenizer:
    chars = ["\n", "\t"] + [chr(i) for i in range(32, 127)]
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {c: i for i, c in enumerate(chars + specials)}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return Tokenizer(hf, bos_id=vocab["<s>"], eos_ids=[vocab["<|im_end|>"]], add_bos=True)


class HashRunner(Runner):
    """Logits that are a fixed random function of (token, position); `rows` > the tokenizer's
    vocabulary pads the output like Gemma 3, with padded rows made the most likely."""

    backend = "numpy"

    def __init__(self, rows: int = VOCAB, seed: int = 0):
        self.spec = ModelSpec(model_type="llama", vocab_size=rows, hidden_size=8, num_layers=1, num_heads=1,
                              num_kv_heads=1, head_dim=8, intermediate_size=8, max_position=4096)
        self.kv = KVLayout(block_size=16, num_blocks=512)
        self.table = np.random.default_rng(seed).normal(0, 3, (rows, 64, rows)).astype(np.float32)
        self.table[:, :, VOCAB:] += 50.0  # padded rows: what an unconstrained row picks

    def step(self, batch: StepBatch) -> np.ndarray:
        tokens, positions = batch.token_ids(), batch.positions()
        return np.stack([self.table[tokens[i], positions[i] % 64] for i in batch.logit_token_index()])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return char_tokenizer()


def engine(tok: Tokenizer, rows: int = VOCAB, proposer: Proposer | None = None) -> Engine:
    return Engine(HashRunner(rows), tok, EngineConfig(max_seqs=16, max_context=2048), proposer)


def params(constraint: Constraint | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 300, "temperature": 0.0, "guard": NO_GUARD, "constraint": constraint, **kw})


# -- hypothesis: generated schemas always validate ---------------------------------------------------
def _leaf() -> Any:
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 1000)),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.text("abcxyz ", min_size=1, max_size=4), min_size=1,
                                                    max_size=3, unique=True)),
        st.builds(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                             "maxItems": n}, st.integers(0, 3)),
        st.just({"type": "null"}),
    )


def _object(children: Any) -> Any:
    names = st.lists(st.text("abcdefgh", min_size=1, max_size=5), min_size=1, max_size=4, unique=True)

    def build(keys: list[str], values: list[Any], required: list[bool]) -> dict[str, Any]:
        props = dict(zip(keys, values, strict=False))
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [k for k, r in zip(props, required, strict=False) if r]}

    return st.builds(build, names, st.lists(children, min_size=4, max_size=4),
                     st.lists(st.booleans(), min_size=4, max_size=4))


SCHEMAS = _object(st.recursive(_leaf(), _object, max_leaves=4))


def test_generated_json_schemas_always_validate(tok: Tokenizer) -> None:
    """200 schemas (25 batches of 8, sampled at temperature 1, two unconstrained rows in each)."""
    e = engine(tok)
    free_alone = e.generate(["free row"], params(max_tokens=24))[0].text
    checked = []

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(schemas=st.lists(SCHEMAS, min_size=8, max_size=8), seed=st.integers(0, 2**32))
    def check(schemas: list[dict[str, Any]], seed: int) -> None:
        ids = [e.add_request(f"json {i}:", params(Constraint.json_schema(s), temperature=1.0, seed=seed + i))
               for i, s in enumerate(schemas)]
        free = e.add_request("free row", params(max_tokens=24))
        done = {}
        while e.has_work:
            done |= {o.request_id: e.requests[o.request_id] for o in e.step() if o.finished}
        for request_id, schema in zip(ids, schemas, strict=True):
            r = done[request_id]
            assert r.finish_reason == "stop", (schema, r.text)
            jsonschema.validate(json.loads(r.text), schema)
            checked.append(schema)
        assert done[free].text == free_alone  # the constrained rows in its batch changed nothing

    check()
    assert len(checked) == 200
    s = e.grammars.stats
    assert s.constrained_requests == 200 and s.mask_steps > 0 and s.rejected_tokens == 0


def test_json_object_always_parses(tok: Tokenizer) -> None:
    outs = engine(tok).generate([f"object {i}" for i in range(8)],
                                params(Constraint("json_object", ""), max_tokens=400, temperature=0.8, seed=3))
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    assert sum(o.finish_reason == "stop" for o in outs) >= 6


@pytest.mark.parametrize("constraint,check", [
    (Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (Constraint.choice(["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
    (Constraint("gbnf", 'root ::= "(" [a-c]+ ")" | "none"'), lambda t: re.fullmatch(r"\([a-c]+\)|none", t)),
    (Constraint("lark", 'start: "x" NUM "y"\nNUM: /[1-9][0-9]?/'), lambda t: re.fullmatch(r"x[1-9][0-9]?y", t)),
], ids=["regex", "choice", "gbnf", "lark"])
def test_regex_choice_and_grammars(tok: Tokenizer, constraint: Constraint, check: Any) -> None:
    outs = engine(tok).generate(["a", "b", "c", "d"], params(constraint, temperature=1.0, seed=5))
    assert all(o.finish_reason == "stop" and check(o.text) for o in outs), [o.text for o in outs]


def test_padded_vocabulary_rows_are_never_allowed(tok: Tokenizer) -> None:
    e = engine(tok, rows=VOCAB + 26)
    free = e.generate(["pad"], params(max_tokens=4))[0]
    assert all(t >= VOCAB for t in free.token_ids)  # unconstrained, the padded rows win
    out = e.generate(["pad"], params(Constraint("regex", "[a-z]{5}")))[0]
    assert re.fullmatch("[a-z]{5}", out.text) and all(t < VOCAB for t in out.token_ids)


def test_logit_bias_minus_100_bans_a_token(tok: Tokenizer) -> None:
    e = engine(tok)
    base = e.generate(["bias"], params(max_tokens=20, ignore_eos=True))[0]
    banned = base.token_ids[0]
    out = e.generate(["bias"], params(max_tokens=20, ignore_eos=True, logit_bias=((banned, -100.0),)))[0]
    assert banned not in out.token_ids and out.token_ids != base.token_ids
    boosted = e.generate(["bias"], params(max_tokens=5, ignore_eos=True, logit_bias=((7, 100.0),)))[0]
    assert boosted.token_ids == [7] * 5
    with pytest.raises(Exception, match="logit_bias"):
        SamplingParams(logit_bias=((1, -101.0),))


def test_bad_constraints_are_request_errors(tok: Tokenizer) -> None:
    e = engine(tok)
    for bad in (Constraint.json_schema({"type": "frobnicate"}), Constraint("regex", "(unclosed"),
                Constraint("lark", "start: missing_rule"), Constraint("gbnf", "root ::= undefined-rule"),
                Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 1})):
        with pytest.raises(GrammarError):
            e.add_request("x", params(bad))
    with pytest.raises(GrammarError):
        Constraint.json_schema("{not json")
    assert not e.has_work and e.metrics.arrived == 0


def test_compile_time_limit_is_cached_as_a_failure(tok: Tokenizer) -> None:
    e = engine(tok)
    e.grammars.time_limit_s = 1e-6
    big = Constraint.choice([f"option number {i}" for i in range(2000)])
    for _ in range(2):
        with pytest.raises(GrammarError, match="longer than"):
            e.add_request("x", params(big))
    assert e.grammars.stats.compiles == 1 and e.grammars.stats.compile_failures == 1


class WildProposer(Proposer):
    """Drafts `k` tokens: the first right (from a recorded reference) half the time, then noise."""

    name = "wild"

    def __init__(self, reference: dict[str, list[int]], prompt_len: int):
        self.reference = reference
        self.prompt_len = prompt_len
        self.rng = np.random.default_rng(1)

    def propose(self, queries: list[DraftQuery]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for q in queries:
            done = len(q.tokens) - self.prompt_len
            ref = next(iter(self.reference.values()))[done:]
            good = int(self.rng.integers(0, q.k + 1))
            tokens = ref[:good] + [int(t) for t in self.rng.integers(0, VOCAB, q.k)]
            out.append(Draft(tokens[: q.k]))
        return out


def test_speculation_with_constraints_is_exact(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9999}},
              "required": ["name", "n"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    plain = engine(tok).generate(["spec"], params(c))[0]
    prompt_len = len(tok.encode("spec"))
    spec_engine = engine(tok, proposer=WildProposer({"r": plain.token_ids}, prompt_len))
    spec_engine.speculator.config = type(spec_engine.speculator.config)(max_k=4, adaptive=False)  # always draft
    out = spec_engine.generate(["spec"], params(c))[0]
    assert out.text == plain.text and out.token_ids == plain.token_ids
    jsonschema.validate(json.loads(out.text), schema)
    stats = spec_engine.speculator.stats
    assert stats.proposed > 0 and 0 < stats.accepted < stats.proposed


def test_properties_come_out_in_the_schemas_order(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    out = engine(tok).generate(["order"], params(Constraint.json_schema(schema)))[0]
    assert list(json.loads(out.text)) == ["zeta", "alpha"]
