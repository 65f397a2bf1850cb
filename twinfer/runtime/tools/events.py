"""What an output parser makes of generated text: content, reasoning and tool calls.

Parsers are fed the decoded text of a request as it streams (`feed`, any split, tags may straddle
deltas) and told when it ends (`finish`); each call returns the `Delta` that is now certain. Text a
parser cannot yet classify (a possible tag start) is held back until the next call decides it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    """One complete call: `arguments` is JSON text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    failures: int = 0  # calls the model opened but wrote malformed (returned as content)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def extend(self, other: Delta) -> Delta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        self.failures += other.failures
        return self


class OutputParser(Protocol):
    """Turns one request's streamed text into content, reasoning and tool calls."""

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class PlainText:
    """Everything is content."""

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
