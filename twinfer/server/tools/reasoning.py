"""`<think>...</think>` reasoning split off the reply (DeepSeek-R1, Qwen 3 and kin): it streams as
`Delta.reasoning`, the rest goes to the inner parser; `started=True` when the prompt opened the block."""

from __future__ import annotations

import json

from twinfer.runtime.constraints.spec import Constraint
from twinfer.server.tools.events import Delta, OutputParser, held_prefix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, inner: OutputParser, started: bool = False):
        self.inner = inner
        self.state = "thinking" if started else "start"  # start -> thinking -> answer
        self.buf = ""
        self.lead = False  # just after </think>: the newlines that separate it from the answer are dropped

    @property
    def done(self) -> bool:
        return self.inner.done

    def feed(self, text: str) -> Delta:
        if self.state == "answer":
            return self._answer(text)
        self.buf += text
        out = Delta()
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.state, self.buf = "thinking", head[len(OPEN) :]
            elif head and not OPEN.startswith(head):
                self.state, text, self.buf = "answer", self.buf, ""
                return self.inner.feed(text)
            else:
                return out
        i = self.buf.find(CLOSE)
        if i < 0:
            keep = held_prefix(self.buf, CLOSE)
            out.reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            return out
        out.reasoning = self.buf[:i]
        rest, self.buf, self.state, self.lead = self.buf[i + len(CLOSE) :], "", "answer", True
        return out.extend(self._answer(rest))

    def _answer(self, text: str) -> Delta:
        if self.lead:
            text = text.lstrip("\n")
            self.lead = not text
        return self.inner.feed(text) if text else Delta()

    def finish(self) -> Delta:
        out = Delta()
        if self.state == "thinking":
            out.reasoning = self.buf
        elif self.state == "start":
            out.extend(self.inner.feed(self.buf))
        self.buf = ""
        return out.extend(self.inner.finish())


# Free text inside an optional think block, then the newlines a model puts after it, then the answer.
_THINK_FIRST = ('start: think? @answer\nthink: think_body NL*\n'
                'think_body[lazy]: "<think>" /(.|\\n)*/ "</think>"\nNL: "\\n"\n')


def after_thinking(constraint: Constraint) -> Constraint:
    """`constraint` applied to the answer only: an optional <think>...</think> block before it is free."""
    grammars = json.loads(constraint.grammar())["grammars"]
    grammars[0] = {**grammars[0], "name": "answer"}
    return Constraint("llguidance", json.dumps({"grammars": [{"name": "thinking", "lark_grammar": _THINK_FIRST},
                                                             *grammars]}))
