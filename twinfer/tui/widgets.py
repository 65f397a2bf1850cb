"""The chat app's widgets: the input box, one message, the loading display and the status panel."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as TextualMessage
from textual.widgets import Label, Markdown, ProgressBar, Static, TextArea
from textual.widgets.markdown import MarkdownStream

from twinfer.tui.backend import ModelInfo
from twinfer.tui.conversation import Message

NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class ChatInput(TextArea):
    """The prompt box: Enter sends, Shift+Enter (or Ctrl+J) inserts a newline; multiline mode (Ctrl+T)
    swaps them (Alt+Enter sends) for terminals that cannot tell Shift+Enter apart."""

    BINDINGS = [Binding("ctrl+t", "toggle_multiline", "Multiline", show=True)]

    class Submitted(TextualMessage):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)  # type: ignore[arg-type]
        self.multiline = False
        self._update_hint()

    async def _on_key(self, event: events.Key) -> None:
        send = event.key == "alt+enter" or (event.key == "enter" and not self.multiline)
        if send:
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)

    def action_toggle_multiline(self) -> None:
        self.multiline = not self.multiline
        self._update_hint()

    def _update_hint(self) -> None:
        if self.multiline:
            self.border_title = "message · multiline: Enter newline, Alt+Enter send (Ctrl+T: off)"
        else:
            self.border_title = "message · Enter send, Shift+Enter newline (Ctrl+T: multiline)"


class MessageView(Vertical):
    """One turn of the conversation. Assistant replies render as Markdown and stream in."""

    def __init__(self, role: str, text: str = "", note: str = "", message: Message | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.message = message  # the conversation's record of this turn (None for errors and notes)
        self.raw = text  # everything the model sent, leading space included
        self._initial = text
        self._note = note
        self._stream: MarkdownStream | None = None
        self.set_class(bool(note), "has-note")

    def compose(self) -> ComposeResult:
        title = {"user": "you", "assistant": "assistant"}.get(self.role, self.role)
        yield Label(title, classes="role")
        if self.role == "assistant":
            yield Markdown(self._initial.strip(), classes="body")
        else:
            yield Static(Text(self._initial), classes="body")
        yield Static(Text(self._note), classes="note")

    @property
    def text(self) -> str:
        return self.raw.strip()

    async def append(self, fragment: str) -> None:
        """Stream more reply text in (Markdown re-renders incrementally)."""
        before = self.raw.lstrip()
        self.raw += fragment
        new = self.raw.lstrip()[len(before):]
        if not new:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(new)

    async def finish(self, note: str = "") -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.set_note(note)

    def set_note(self, note: str) -> None:
        self._note = note
        self.query_one(".note", Static).update(Text(note))
        self.set_class(bool(note), "has-note")


class LoadingPanel(Vertical):
    """Shown while the model loads: a step counter, what is happening, and a bar."""

    def compose(self) -> ComposeResult:
        yield Label("loading the model", id="loading-label")
        yield ProgressBar(total=4, show_eta=False, id="loading-bar")

    def show_step(self, step: int, total: int, what: str) -> None:
        self.query_one("#loading-label", Label).update(Text(f"[{step + 1}/{total + 1}] {what}..."))
        bar = self.query_one(ProgressBar)
        bar.update(total=total, progress=step)


@dataclass(frozen=True)
class ReplyStats:
    """Numbers about the latest reply, for the status panel."""

    tokens_per_s: float = 0.0
    ttft_s: float | None = None
    context_used: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""


class StatusPanel(Static):
    """Model, backend, the planner's choice, and live generation numbers."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.info: ModelInfo | None = None
        self.state = "starting"
        self.stats = ReplyStats()

    def on_mount(self) -> None:
        self.border_title = "status"
        self.refresh_panel()

    def set_state(self, state: str, info: ModelInfo | None = None) -> None:
        self.state = state
        if info is not None:
            self.info = info
        self.refresh_panel()

    def set_stats(self, stats: ReplyStats) -> None:
        self.stats = stats
        self.refresh_panel()

    def refresh_panel(self) -> None:
        self.update(self.render_table())

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs; a label starting with "#" is a section heading."""
        rows: list[tuple[str, str]] = [("state", self.state)]
        info = self.info
        if info is not None:
            rows += [("model", info.name), ("backend", info.backend), ("prompt", info.prompt_format)]
            p = info.plan
            if p is not None:
                rows += [("#plan", ""), ("weights", p.weights), ("KV", p.kv), ("memory", p.memory),
                         ("experts", p.experts), ("hardware", p.hardware)]
            elif info.plan_error:
                rows += [("#plan", ""), ("plan", f"unavailable: {info.plan_error}")]
        s = self.stats
        window = info.window if info else 0
        rows += [
            ("#last reply", ""),
            ("tokens/s", f"{s.tokens_per_s:.1f}" if s.tokens_per_s else "-"),
            ("TTFT", f"{s.ttft_s * 1000:.0f} ms" if s.ttft_s is not None else "-"),
            ("context", f"{s.context_used} / {window}" if window else "-"),
            ("reply", f"{s.completion_tokens} tokens, {s.finish_reason}" if s.finish_reason else "-"),
        ]
        return rows

    def render_table(self) -> Table:
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for label, value in self.rows():
            if label.startswith("#"):
                table.add_row("")
                table.add_row(Text(label[1:], style="dim italic"), "")
            else:
                table.add_row(label, Text(value))
        return table

    def plain(self) -> str:
        """The panel as text, for tests and logs."""
        return "\n".join(f"{label} {value}".strip() for label, value in self.rows())
