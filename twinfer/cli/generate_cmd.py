"""`twinfer generate`: stream one completion to stdout."""

from __future__ import annotations

import sys

from twinfer.runtime.engine import SamplingParams
from twinfer.runtime.errors import RequestError


def run_generate(model: str | None, prompt: str, max_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int | None, backend: str, chat: bool | None, threads: int | None,
                 speculate: str = "off", parallel: tuple[int, int, int] = (1, 1, 1),
                 budget: tuple[str | None, bool] = (None, False)) -> None:
    from twinfer.app import OpenOptions, open_session

    if not prompt.strip():
        raise RequestError("the prompt is empty: give the text to continue, e.g. twinfer generate 'Hello'")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    options = OpenOptions(model, backend, max_seqs=1, threads=threads, speculate=speculate, parallel=parallel,
                          memory_budget=budget[0], allow_pruning=budget[1])
    session = open_session(options)
    if session.strategy is not None:  # --memory-budget: say what the planner chose
        print(f"twinfer: {session.strategy.summary()}", file=sys.stderr)
    tokenizer = session.opened.tokenizer
    if chat is None:
        chat = session.opened.instruct
    if chat and tokenizer.chat_template:
        tokens = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        tokens = tokenizer.encode(prompt)
    engine = session.engine()
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
