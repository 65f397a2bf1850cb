"""What an output parser makes of generated text: content, reasoning and tool calls. Parsers are fed
text as it streams (`feed`) and told when it ends (`finish`); each returns the `Delta` now certain."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One complete call: `arguments` is JSON text (OpenAI's wire form); `index` is its place among
    the choice's calls once a parser has numbered it (None: numbered by arrival)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)
    index: int | None = None


@dataclass
class CallPart:
    """A piece of a call still being generated: the first has `id` and `name` (and no arguments),
    the later ones fragments of `arguments`; a call's fragments joined are its final arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    failures: int = 0  # calls the model opened but wrote malformed (returned as content)
    parts: list[CallPart] = field(default_factory=list)  # calls streamed as they are generated

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls or self.parts)

    def extend(self, other: Delta) -> Delta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        self.failures += other.failures
        self.parts += other.parts
        return self


class OutputParser(Protocol):
    """Turns one request's streamed text into content, reasoning and tool calls. `done` turns true
    when the rest of the reply is unwanted (its calls are over): the server then stops generating."""

    @property
    def done(self) -> bool: ...

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class PlainText:
    """Everything is content."""

    done = False

    def feed(self, text: str) -> Delta:
        return Delta(content=text)

    def finish(self) -> Delta:
        return Delta()


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back: it may
    be the start of the tag, split across stream deltas)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
