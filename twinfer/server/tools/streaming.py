"""Tool-call arguments streamed as they are generated (as vLLM and OpenAI stream them): once a call's
name and the `{` of its arguments are out, the call's id and name go first, then each new piece of
its argument text; when the call completes, its `arguments` are exactly the pieces joined.

`CallStreams` keeps one choice's calls; a parser hands it the text of a call region as it grows
(`show`: a Hermes block, a whole generic/Llama 3/Mistral reply, a harmony message body) and, when the
parser has decided a region's calls, lets it number them and match them to what was streamed
(`settle`). A call the parser then finds malformed has already been sent in part; it also comes back
as content and is counted, as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from twinfer.server.tools.events import CallPart, Delta, ToolCall, new_call_id

# `{"name": "NAME", "arguments": {` (or "parameters", Llama 3's key), the arguments' brace not consumed.
HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def object_end(text: str, start: int) -> int | None:
    """The index just past the JSON object opening at `text[start]`, or None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class _Open:
    index: int
    id: str
    name: str
    start: int  # where the arguments begin in the region's text
    sent: int = 0  # characters of the arguments already streamed
    end: int | None = None


class CallStreams:
    """One choice's streamed calls, numbered in the order they begin."""

    def __init__(self, names: Collection[str]):
        self.names = names
        self.count = 0
        self.region: list[_Open] = []  # calls streamed from the current region

    def new_region(self) -> None:
        self.region = []

    def show(self, text: str, out: Delta) -> None:
        """The current region's text so far (JSON calls): stream what is new of its calls."""
        pos = 0
        for call in self.region:
            self._advance(call, text, out)
            if call.end is None:
                return
            pos = call.end
        while (m := HEAD.search(text, pos)) is not None and m.group(1) in self.names:
            call = self.begin(m.group(1), out, m.end())
            self._advance(call, text, out)
            if call.end is None:
                return
            pos = call.end

    def begin(self, name: str, out: Delta, start: int = 0) -> _Open:
        """A call whose arguments start at `start` of the region: its id and name go out now."""
        call = _Open(self.count, new_call_id(), name, start)
        self.count += 1
        self.region.append(call)
        out.parts.append(CallPart(call.index, id=call.id, name=name))
        return call

    def body(self, text: str, out: Delta, final: bool = False) -> None:
        """The region is one call's arguments (a harmony message body): stream `text` as it grows."""
        call = self.region[-1]
        if final:
            call.end = len(text)
        self._send(call, text[call.start : len(text)], out)

    def _advance(self, call: _Open, text: str, out: Delta) -> None:
        call.end = object_end(text, call.start)
        self._send(call, text[call.start : call.end if call.end is not None else len(text)], out)

    @staticmethod
    def _send(call: _Open, arguments: str, out: Delta) -> None:
        if len(arguments) > call.sent:
            out.parts.append(CallPart(call.index, arguments[call.sent :]))
            call.sent = len(arguments)

    def settle(self, text: str, calls: list[ToolCall]) -> list[ToolCall]:
        """The region's decided `calls`, numbered; a call that was streamed keeps its id, and its
        arguments are the streamed text (the same JSON value, as generated)."""
        streamed = iter(self.region)
        for call in calls:
            match = next(streamed, None)
            if match is not None and match.name == call.name and match.end is not None:
                raw = text[match.start : match.end]
                if _same_json(raw, call.arguments):
                    call.id, call.index, call.arguments = match.id, match.index, raw
                    continue
            call.index = self.count
            self.count += 1
        self.region = []
        return calls


def _same_json(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False
