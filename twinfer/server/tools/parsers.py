"""Tool-call output parsers, one per template family (hermes, llama3, mistral, harmony, generic), all
streaming. A call that does not parse comes back as content, counted in `Delta.failures`; a cut reply
keeps its complete calls (docs/internals.md, "Tool calls")."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from twinfer.server.tools.events import Delta, ToolCall, held_prefix
from twinfer.server.tools.harmony import HarmonyParser
from twinfer.server.tools.streaming import CallStreams


def _calls(items: Any, names: Collection[str], args_key: tuple[str, ...] = ("arguments", "parameters")
           ) -> list[ToolCall] | None:
    """ToolCalls from decoded JSON items, or None when any item is not a call of a known function."""
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return None
    out = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args: Any = next((item[k] for k in args_key if k in item), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        out.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return out


class TaggedParser:
    """`open`...`close` blocks holding one JSON call each (hermes)."""

    def __init__(self, names: Collection[str], open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.names = names
        self.open_tag, self.close_tag = open_tag, close_tag
        self.buf = ""
        self.inside = False
        self.streams = CallStreams(names)

    @property
    def done(self) -> bool:
        """The reply's calls are over (a call repeated an earlier one); the rest may be cut."""
        return self.streams.repeated

    def feed(self, text: str) -> Delta:
        if self.done:
            return Delta()
        self.buf += text
        out = Delta()
        while True:
            if not self.inside:
                i = self.buf.find(self.open_tag)
                if i < 0:
                    keep = held_prefix(self.buf, self.open_tag)
                    out.content += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out.content += self.buf[:i]
                self.buf, self.inside = self.buf[i + len(self.open_tag) :], True
                self.streams.new_region()
            j = self.buf.find(self.close_tag)
            if j < 0:
                self.streams.show(self.buf, out)
                return out
            self.streams.show(self.buf[:j], out)
            if self.done:
                self.buf = ""
                return out
            self._call(self.buf[:j], out, self.buf[: j + len(self.close_tag)])
            self.buf, self.inside = self.buf[j + len(self.close_tag) :], False

    def _call(self, body: str, out: Delta, raw: str) -> None:
        try:
            calls = _calls(json.loads(body), self.names)
        except ValueError:
            calls = None
        if calls is None:
            out.content += self.open_tag + raw
            out.failures += 1
            self.streams.new_region()
        else:
            out.calls += self.streams.settle(body, calls)

    def finish(self) -> Delta:
        out = Delta()
        if self.done:  # what follows a repeated call is dropped
            pass
        elif self.inside:  # an unclosed call: take it if its JSON is complete
            self.streams.show(self.buf, out)
            if not self.done:
                self._call(self.buf, out, self.buf)
        else:
            out.content += self.buf
        self.buf, self.inside = "", False
        return out


class WholeReplyParser:
    """A reply that is a tool call from its first character on (generic, llama3, mistral): text
    that cannot start one streams as content; otherwise it is held and parsed at the end."""

    def __init__(self, names: Collection[str], family: str):
        self.names = names
        self.family = family
        # Control tokens ([TOOL_CALLS], <|python_tag|>) are dropped from the decoded text, so a call may
        # arrive without its tag.
        self.starts = {"generic": ("{",), "llama3": ("{", "<|python_tag|>"),
                       "mistral": ("[TOOL_CALLS]", '[{"name"')}[family]
        self.buf = ""
        self.holding: bool | None = None  # None: undecided (only whitespace or a tag prefix so far)
        self.streams = CallStreams(names)

    @property
    def done(self) -> bool:
        """The reply's calls are over (a call repeated an earlier one); the rest may be cut."""
        return self.streams.repeated

    def feed(self, text: str) -> Delta:
        if self.holding is False:
            return Delta(content=text)
        if self.done:
            return Delta()
        self.buf += text
        head = self.buf.lstrip()
        if any(head.startswith(s) for s in self.starts):
            self.holding = True
            out = Delta()
            self.streams.show(self.buf, out)
            return out
        elif head and not any(s.startswith(head) for s in self.starts):
            self.holding = False
            text, self.buf = self.buf, ""
            return Delta(content=text)
        return Delta()

    def finish(self) -> Delta:
        text, self.buf = self.buf, ""
        if not self.holding:
            return Delta(content=text)
        out = Delta()
        self.streams.show(text, out)
        calls = None if self.done else self._parse(text.strip())
        if calls is None:
            complete = self.streams.complete(text)  # a list cut short keeps its complete calls
            if complete:
                return out.extend(Delta(calls=complete))
            return out.extend(Delta(content=text, failures=1))
        return out.extend(Delta(calls=self.streams.settle(text, calls)))

    def _parse(self, text: str) -> list[ToolCall] | None:
        try:
            if self.family == "generic":
                data = json.loads(text)
                return _calls(data.get("tool_calls"), self.names) if isinstance(data, dict) else None
            if self.family == "mistral":
                return _calls(json.loads(text.removeprefix("[TOOL_CALLS]").strip()), self.names)
            body = text.removeprefix("<|python_tag|>").strip()
            calls: list[ToolCall] = []
            for part in body.split(";") if not body.startswith("[") else [body]:
                found = _calls(json.loads(part), self.names)
                if found is None:
                    return None
                calls += found
            return calls
        except ValueError:
            return None


def parser_for(family: str, names: Collection[str]) -> TaggedParser | WholeReplyParser | HarmonyParser:
    if family == "hermes":
        return TaggedParser(names)
    if family == "harmony":
        return HarmonyParser(names)
    return WholeReplyParser(names, family)
