"""A burst that finds the engine idle prefills in one step (`AsyncEngine(gather_s=...)`).

Without gathering, the first request of a burst starts alone and the rest wait behind that step
(traced under `twinfer serve`: a 0.3 s step of one 100-token prompt, the other fifteen queued behind
it). The verdicts here do not depend on the machine's speed: arrivals are 10 ms apart against a 0.5 s
gap, and "started at once" is read from the runner's own step, not from a clock.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.async_engine import AsyncEngine
from twinfer.runtime.runner import KVLayout, Runner
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.tokenizer import Tokenizer

VOCAB = 40
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))


class StepLog(Runner):
    """Constant logits; records how many prompts start in each step, and can hold a step open."""

    backend = "numpy"

    def __init__(self, step_s: float = 0.0) -> None:
        self.spec = ModelSpec(model_type="llama", vocab_size=VOCAB, hidden_size=8, num_layers=1, num_heads=1,
                              num_kv_heads=1, head_dim=8, intermediate_size=8, max_position=512)
        self.kv = KVLayout(block_size=16, num_blocks=64)
        self.step_s = step_s
        self.prompts_per_step: list[int] = []
        self.stepping = threading.Event()

    def step(self, batch: StepBatch) -> np.ndarray:
        self.prompts_per_step.append(sum(c.start == 0 for c in batch.chunks))
        self.stepping.set()
        time.sleep(self.step_s)
        return np.zeros((batch.num_logit_rows, VOCAB), dtype=np.float32)


def tokenizer() -> Tokenizer:
    vocab = {chr(97 + i): i for i in range(26)} | {"<s>": 26, "</s>": 27, "<unk>": 28}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    return Tokenizer(hf, bos_id=26, eos_ids=[27], add_bos=True)


def engine(runner: StepLog, max_seqs: int = 8, **kw: float | None) -> AsyncEngine:
    return AsyncEngine(Engine(runner, tokenizer(), EngineConfig(max_seqs=max_seqs, max_context=256)), **kw)  # type: ignore[arg-type]


async def finish(ae: AsyncEngine, prompt: list[int]) -> None:
    stream = await ae.generate(prompt, PARAMS)
    async for _ in stream:
        pass


async def burst(ae: AsyncEngine, n: int, apart_s: float) -> None:
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(finish(ae, [1 + i, 2, 3])))
        await asyncio.sleep(apart_s)
    await asyncio.gather(*tasks)


def test_a_burst_that_finds_the_engine_idle_prefills_in_one_step() -> None:
    runner = StepLog()
    ae = engine(runner, gather_s=0.5)
    ae.start()
    asyncio.run(burst(ae, 3, 0.01))
    assert runner.prompts_per_step[0] == 3


def test_without_gathering_the_first_request_starts_alone() -> None:
    runner = StepLog(step_s=0.2)
    ae = engine(runner, gather_s=0.0)
    ae.start()

    async def main() -> None:
        first = asyncio.create_task(finish(ae, [1, 2, 3]))
        assert await asyncio.to_thread(runner.stepping.wait, 10.0)
        await finish(ae, [4, 5, 6])
        await first

    asyncio.run(main())
    assert runner.prompts_per_step[0] == 1


def test_gathering_stops_once_the_engine_is_full() -> None:
    runner = StepLog()
    ae = engine(runner, max_seqs=2, gather_s=30.0)  # a gap no test waits out
    ae.start()

    async def main() -> None:
        tasks = [asyncio.create_task(finish(ae, [1 + i, 2])) for i in range(2)]
        assert await asyncio.to_thread(runner.stepping.wait, 10.0), "the step waited past a full engine"
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert runner.prompts_per_step[0] == 2


def test_the_default_gap_is_a_tenth_of_a_start_at_most_50_ms() -> None:
    runner = StepLog(step_s=0.2)
    ae = engine(runner, gather_s=None)
    assert ae.gather_gap_s() == 0.0  # nothing measured yet: start at once
    ae.start()
    asyncio.run(finish(ae, [1, 2, 3]))
    assert 0.02 <= ae.gather_gap_s() <= AsyncEngine.GATHER_MAX_S


def test_a_lone_client_never_waits_and_a_burst_turns_gathering_back_on() -> None:
    """One client at a time (each request after the last finished): once a start from idle had no company,
    the next starts at once; a burst queued behind a lone start turns the gap back on for the next one."""
    runner = StepLog(step_s=0.45)  # a gap of 45 ms once measured, against arrivals 10 ms apart
    ae = engine(runner, gather_s=None)
    ae.start()

    async def main() -> None:
        for i in range(3):
            await finish(ae, [1 + i, 2, 3])
            await asyncio.sleep(0.3)  # past four gaps of at most 50 ms
        assert ae.gather_gap_s() == 0.0
        await burst(ae, 3, 0.01)
        assert 0.02 <= ae.gather_gap_s() <= AsyncEngine.GATHER_MAX_S
        await burst(ae, 3, 0.01)

    asyncio.run(main())
    steps = runner.prompts_per_step  # prompts starting in each step: a request is a prefill and a decode
    assert steps == [1, 0] * 3 + [1, 2, 0] + [3, 0], steps  # lone starts; a burst's first alone; then gathered


def test_a_negative_gap_is_refused() -> None:
    with pytest.raises(ValueError, match="gather_s"):
        engine(StepLog(), gather_s=-1.0)
