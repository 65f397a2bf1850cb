"""Tool-call arguments streamed as they are generated (as vLLM and OpenAI stream them): id and name
first, then argument pieces that join to the final `arguments`. A call repeating an earlier one word for
word ends the reply's calls and is never streamed (docs/internals.md, "Tool calls")."""

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
    announced: bool = False  # its id and name went out
    repeat: bool = False  # complete, and word for word an earlier call


class CallStreams:
    """One choice's streamed calls, numbered in the order they begin."""

    def __init__(self, names: Collection[str]):
        self.names = names
        self.count = 0
        self.region: list[_Open] = []  # calls streamed from the current region
        self.done: list[tuple[str, str]] = []  # (name, argument text) of every complete call so far
        self.repeated = False  # a complete call repeated an earlier one: the reply's calls are over

    def new_region(self) -> None:
        self.region = []

    def show(self, text: str, out: Delta) -> None:
        """The current region's text so far (JSON calls): stream what is new of its calls."""
        pos = 0
        for call in self.region:
            if call.end is None:
                self._advance(call, text, out)
            if call.end is None or self.repeated:
                return
            pos = call.end
        while not self.repeated and (m := HEAD.search(text, pos)) is not None and m.group(1) in self.names:
            call = self.begin(m.group(1), out, m.end())
            self._advance(call, text, out)
            if call.end is None:
                return
            pos = call.end

    def begin(self, name: str, out: Delta, start: int = 0) -> _Open:
        """A call whose arguments start at `start` of the region: its id and name go out now, unless
        it may yet repeat an earlier call."""
        call = _Open(self.count, new_call_id(), name, start)
        self.count += 1
        self.region.append(call)
        if not any(n == name for n, _ in self.done):
            self._announce(call, out)
        return call

    def _announce(self, call: _Open, out: Delta) -> None:
        call.announced = True
        out.parts.append(CallPart(call.index, id=call.id, name=call.name))

    def complete(self, text: str) -> list[ToolCall]:
        """The region's complete calls before any repetition (what a cut reply still holds), numbered."""
        calls = []
        for call in self.region:
            if call.end is None:
                break
            if call.repeat:
                break
            raw = text[call.start : call.end]
            try:
                json.loads(raw)
            except ValueError:
                break
            calls.append(ToolCall(call.name, raw, call.id, call.index))
        self.region = []
        return calls

    def body(self, text: str, out: Delta, final: bool = False) -> None:
        """The region is one call's arguments (a harmony message body): stream `text` as it grows."""
        call = self.region[-1]
        if not call.announced:
            self._announce(call, out)
        if final:
            call.end = len(text)
        self._send(call, text[call.start : len(text)], out)

    def _advance(self, call: _Open, text: str, out: Delta) -> None:
        call.end = object_end(text, call.start)
        arguments = text[call.start : call.end if call.end is not None else len(text)]
        if call.end is not None:
            if (call.name, arguments) in self.done:
                call.repeat = self.repeated = True
                return
            self.done.append((call.name, arguments))
        if not call.announced:
            if call.end is None and any(n == call.name and a.startswith(arguments) for n, a in self.done):
                return  # it may still become a repetition
            self._announce(call, out)
        self._send(call, arguments, out)

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
