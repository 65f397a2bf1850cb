"""`twinfer generate`: stream one completion to stdout."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from twinfer.app import OpenOptions
from twinfer.runtime.engine import SamplingParams
from twinfer.runtime.errors import RequestError


@dataclass(frozen=True)
class GenerateOptions:
    """`twinfer generate`'s flags: the model to open, the prompt and how to sample it."""

    open: OpenOptions
    prompt: str
    sampling: SamplingParams
    chat: bool | None = None  # wrap the prompt in the chat template; None: for chat-tuned models only

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise RequestError("the prompt is empty: give the text to continue, e.g. twinfer generate 'Hello'",
                               field="prompt")


def run_generate(options: GenerateOptions) -> None:
    from twinfer.app import open_session

    session = open_session(options.open)
    if session.strategy is not None:  # --memory-budget: say what the planner chose
        print(f"twinfer: {session.strategy.summary()}", file=sys.stderr)
    tokenizer = session.opened.tokenizer
    chat = session.opened.instruct if options.chat is None else options.chat
    if chat and tokenizer.chat_template:
        tokens = tokenizer.encode_chat([{"role": "user", "content": options.prompt}])
    else:
        tokens = tokenizer.encode(options.prompt)
    engine = session.engine()
    engine.add_request(tokens, options.sampling)
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
