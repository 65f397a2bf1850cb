"""gpt-oss's harmony format: `analysis` is reasoning, `final` content, a message `to=functions.NAME` a
call; the parser reads text decoded with control tokens (`wants_special_tokens`)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from twinfer.server.tools.events import Delta, ToolCall, held_prefix
from twinfer.server.tools.streaming import CallStreams

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([\w.-]+)")
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")


class HarmonyParser:
    wants_special_tokens = True
    done = False  # harmony ends a call turn on <|call|>, an end-of-generation token

    def __init__(self, names: Collection[str]):
        self.names = names
        self.buf = ""
        self.header: str | None = None  # the current message's header once its <|message|> is seen
        self.streams = CallStreams(names)  # a call's body streams as its arguments

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if self.header is None:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    return out
                self.header, self.buf = self.buf[:i], self.buf[i + len(MESSAGE) :]
                self.streams.new_region()
            end = min((j for j in (self.buf.find(e) for e in ENDS) if j >= 0), default=-1)
            if end < 0:
                self._stream(out, final=False)
                return out
            body = self.buf[:end]
            self.buf = self.buf[end:].split(">", 1)[1] if ">" in self.buf[end:] else ""
            self._close(body, out)

    def _kind(self) -> tuple[str, str | None]:
        header = self.header or ""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        return (channel.group(1) if channel else "final"), (recipient.group(1) if recipient else None)

    def _stream(self, out: Delta, final: bool) -> None:
        """Send what is certain of a body: reasoning, content, or a known function's arguments."""
        channel, recipient = self._kind()
        if recipient is not None:
            if recipient in self.names and not final:
                if not self.streams.region:
                    self.streams.begin(recipient, out)
                keep = max(held_prefix(self.buf, e) for e in ENDS)
                self.streams.body(self.buf[: len(self.buf) - keep], out)
            return
        keep = 0 if final else max(held_prefix(self.buf, e) for e in ENDS)
        piece, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        if channel == "analysis":
            out.reasoning += piece
        else:
            out.content += piece

    def _close(self, body: str, out: Delta) -> None:
        channel, recipient = self._kind()
        self.header = None
        if recipient is None:
            if channel == "analysis":
                out.reasoning += body
            else:
                out.content += body
            return
        try:
            args = json.loads(body) if body.strip() else {}
        except ValueError:
            args = None
        if recipient in self.names and isinstance(args, dict):
            if self.streams.region:
                self.streams.body(body, out, final=True)
            out.calls += self.streams.settle(body, [ToolCall(recipient, json.dumps(args, ensure_ascii=False))])
        else:
            out.content += body
            out.failures += 1
            self.streams.new_region()

    def finish(self) -> Delta:
        out = Delta()
        if self.header is not None:
            channel, recipient = self._kind()
            if recipient is None:
                self._stream(out, final=True)
                self.header = None
            else:
                body, self.buf = self.buf, ""
                self._close(body, out)
        self.buf = ""
        return out
