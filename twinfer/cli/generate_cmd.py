"""`twinfer generate`: stream one completion to stdout."""

from __future__ import annotations

import sys

from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams
from twinfer.runtime.errors import RequestError
from twinfer.runtime.load import open_model


def run_generate(model: str | None, prompt: str, max_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int | None, backend: str, chat: bool | None, threads: int | None,
                 speculate: str = "off", parallel: tuple[int, int, int] = (1, 1, 1),
                 budget: tuple[str | None, bool] = (None, False)) -> None:
    from twinfer.runtime.speculative.options import open_proposer, parse_speculate

    if not prompt.strip():
        raise RequestError("the prompt is empty: give the text to continue, e.g. twinfer generate 'Hello'")
    parse_speculate(speculate)  # a typo fails before the model loads
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if budget[0] is not None:  # --memory-budget: apply the planner's local strategy and say what it is
        from twinfer.runtime.budget import open_with_budget

        opened, strategy = open_with_budget(model, backend, budget[0], allow_pruning=budget[1], max_seqs=1,
                                            ctx=4096, threads=threads)
        print(f"twinfer: {strategy.summary()}", file=sys.stderr)
    else:
        opened = open_model(model, backend, max_seqs=1, ctx=4096, threads=threads, parallel=parallel)
    proposer = open_proposer(speculate, opened, max_seqs=1, ctx=4096, threads=threads)
    tokenizer = opened.tokenizer
    if chat is None:
        chat = opened.instruct
    if chat and tokenizer.chat_template:
        tokens = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        tokens = tokenizer.encode(prompt)
    engine = Engine(opened.runner, tokenizer, EngineConfig(max_seqs=1), proposer)
    engine.add_request(tokens, params)
    reason = None
    while engine.has_work:
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                reason = out.finish_reason
    sys.stdout.write("\n")
    if reason == "loop":
        print("twinfer: generation stopped: the model repeated itself (loop guard)", file=sys.stderr)
