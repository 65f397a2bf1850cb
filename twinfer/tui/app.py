"""`ChatApp`: the Textual chat front end. The model loads on a worker thread; replies stream from the
engine thread; every user-caused failure becomes a message saying what to do, and the app keeps running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Header

from twinfer.runtime.engine import RequestOutput
from twinfer.runtime.errors import ModelError, TwinferError
from twinfer.tui.backend import ChatBackend, LoadOptions, Progress, describe_error, load_backend
from twinfer.tui.conversation import DEFAULT_SYSTEM, Conversation, ConversationStore, Message, Settings
from twinfer.tui.dialogs import OpenScreen, SettingsResult, SettingsScreen
from twinfer.tui.prompt import build_prompt
from twinfer.tui.widgets import ChatInput, LoadingPanel, MessageView, ReplyStats, StatusPanel

Loader = Callable[[LoadOptions, Progress], ChatBackend]

FINISH_NOTES = {
    "abort": "stopped (Esc). Ctrl+R regenerates the reply.",
    "length": "cut at the max-tokens limit: raise it in Settings (Ctrl+S), or ask the model to go on.",
    "loop": "the model began repeating itself, so the loop guard stopped it. Regenerate (Ctrl+R), "
            "raise the temperature in Settings (Ctrl+S), or rephrase.",
}

CSS = """
#main { height: 1fr; }
#conversation { width: 1fr; padding: 0 1; }
#status { width: 42; height: 1fr; border: round $primary; padding: 0 1; }
ChatInput { height: auto; min-height: 3; max-height: 12; border: round $accent; }
ChatInput:focus { border: round $accent-lighten-2; }
LoadingPanel { height: auto; border: round $warning; padding: 0 1; margin-bottom: 1; }
LoadingPanel ProgressBar { width: 100%; }
.message { height: auto; margin-bottom: 1; }
.message .role { text-style: bold; color: $accent; }
.message.user .role { color: $success; }
.message.error { border-left: thick $error; padding-left: 1; }
.message.error .role { color: $error; }
.message.info { border-left: thick $primary; padding-left: 1; }
.message Markdown { margin: 0; padding: 0; }
.message Markdown > *:last-child { margin-bottom: 0; }
.message .note { display: none; color: $text-muted; text-style: italic; }
.message.has-note .note { display: block; }
ModalScreen { align: center middle; }
.dialog { width: 76; height: auto; max-height: 100%; border: thick $primary; background: $surface; padding: 0 2; }
.dialog-title { text-style: bold; margin: 1 0; }
#settings-grid { grid-size: 2; grid-columns: 28 1fr; grid-rows: 1; grid-gutter: 1 0; height: auto; margin-bottom: 1; }
#settings-grid Input { border: none; height: 1; padding: 0 1; background: $boost; }
#settings-grid Input:focus { background: $primary 30%; }
#system { height: 4; }
#saved { height: auto; max-height: 16; }
.error { color: $error; }
.buttons { height: auto; margin-top: 1; }
.buttons Button { margin-right: 2; }
"""


@dataclass(frozen=True)
class ChatOptions:
    """What `twinfer chat` was started with."""

    load: LoadOptions = field(default_factory=LoadOptions)
    system: str = DEFAULT_SYSTEM
    settings: Settings = field(default_factory=Settings)
    resume: str | None = None  # a saved conversation's id, or "last"


class ChatApp(App[None]):
    TITLE = "twinfer chat"
    CSS = CSS
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+l", "copy_reply", "Copy reply"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "open", "Open"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, options: ChatOptions | None = None, *, store: ConversationStore | None = None,
                 loader: Loader | None = None):
        super().__init__()
        self.options = options or ChatOptions()
        self.store = store or ConversationStore()
        self.loader: Loader = loader or load_backend
        self.backend: ChatBackend | None = None
        self.load_error: str | None = None
        self.conversation = Conversation(system=self.options.system, settings=self.options.settings)
        self.generating = False
        self.request_id: str | None = None
        self.last_output: RequestOutput | None = None
        self.reply_stats = ReplyStats()
        self._regenerations = 0

    # -- layout and start-up -------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(LoadingPanel(id="loading"), id="conversation")
            yield StatusPanel(id="status")
        yield ChatInput(id="input")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#conversation", VerticalScroll).anchor()
        self.query_one(ChatInput).focus()
        if self.options.resume:
            try:
                await self.show_conversation(self.store.load(self.options.resume))
            except TwinferError as exc:
                await self.add_note("error", f"could not reopen conversation: {exc}")
        self.status.set_state("loading")
        self.run_worker(self._load, thread=True, group="load", exit_on_error=False)

    @property
    def status(self) -> StatusPanel:
        return self.query_one(StatusPanel)

    def _load(self) -> None:
        """Worker thread: load the model, then hand it (or the error) to the event loop."""
        def progress(step: int, total: int, what: str) -> None:
            self.call_from_thread(self._show_progress, step, total, what)

        try:
            backend = self.loader(self.options.load, progress)
        except Exception as exc:  # noqa: BLE001 - every load failure becomes a message in the app
            self.call_from_thread(self._load_failed, exc)  # type: ignore[arg-type]
            return
        try:
            self.call_from_thread(self._loaded, backend)  # type: ignore[arg-type]
        except RuntimeError:  # the app closed while loading: nothing will use the model
            asyncio.run(backend.close())

    def _show_progress(self, step: int, total: int, what: str) -> None:
        for panel in self.query(LoadingPanel):
            panel.show_step(step, total, what)

    async def _loaded(self, backend: ChatBackend) -> None:
        info = backend.info
        self.conversation.model = info.name
        self.sub_title = f"{info.name} · {info.backend}"
        self.status.set_state("ready", info)
        self.backend = backend  # after the status says ready: the two change together for anyone watching
        await self.query_one(LoadingPanel).remove()
        if info.prompt_format == "transcript":
            await self.add_note("info", f"{info.name} is a base model (not chat-tuned): twinfer writes the chat "
                                        "as a User:/Assistant: transcript for it to continue. Expect short, rough "
                                        "answers; a chat-tuned model (-it, instruct) does better.", first=True)

    async def _load_failed(self, exc: BaseException) -> None:
        message = describe_error(exc)
        if isinstance(exc, ModelError):
            message += ("\n\nStart `twinfer chat PATH` with a GGUF file or a Hugging Face model folder, or "
                        "`twinfer chat` alone for the built-in Gemma 3 270M.")
        self.load_error = message
        await self.query_one(LoadingPanel).remove()
        self.status.set_state("no model loaded")
        await self.add_note("error", f"could not load the model: {message}")

    async def on_unmount(self) -> None:
        if self.backend is not None:
            backend, self.backend = self.backend, None
            await backend.close()

    # -- the conversation view -----------------------------------------------------------------------
    async def add_view(self, view: MessageView, first: bool = False) -> MessageView:
        container = self.query_one("#conversation", VerticalScroll)
        await container.mount(view, before=0 if first and container.children else None)
        return view

    async def add_note(self, kind: str, text: str, first: bool = False) -> MessageView:
        """An error or info message: shown, never sent to the model, not saved."""
        return await self.add_view(MessageView(kind, text), first)

    async def show_conversation(self, conversation: Conversation) -> None:
        await self.query(MessageView).filter(".user, .assistant, .error").remove()
        self.conversation = conversation
        for m in conversation.messages:
            note = FINISH_NOTES.get(m.meta.get("finish_reason", ""), "")
            await self.add_view(MessageView(m.role, m.content, note, message=m))
        self.reply_stats = ReplyStats()
        self.status.set_stats(self.reply_stats)

    def view_of(self, message: Message) -> MessageView | None:
        for view in self.query(MessageView):
            if view.message is message:
                return view
        return None

    def save(self) -> None:
        if not self.conversation.messages:
            return
        try:
            self.store.save(self.conversation)
        except OSError as exc:
            self.notify(f"could not save the conversation to {self.store.root}: {exc}", severity="error")

    # -- sending and streaming -------------------------------------------------------------------------
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.generating:
            self.notify("a reply is still streaming: wait for it or press Esc to stop it", severity="warning")
            return
        if self.backend is None:
            if self.load_error is None:
                self.notify("the model is still loading; your message stays in the box", severity="warning")
            else:
                await self.add_note("error", "no model is loaded, so there is nobody to answer: quit (Ctrl+Q) "
                                             "and start `twinfer chat` with a model that loads (see above).")
            return
        self.query_one(ChatInput).clear()
        message = Message("user", text)
        self.conversation.messages.append(message)
        await self.add_view(MessageView("user", text, message=message))
        await self.start_reply()

    async def start_reply(self, seed_offset: int = 0) -> None:
        assert self.backend is not None
        view = await self.add_view(MessageView("assistant"))
        self.generating = True
        self.status.set_state("generating")
        self.run_worker(self._reply(self.backend, view, seed_offset), group="reply", exclusive=True,
                        exit_on_error=False)

    async def _reply(self, backend: ChatBackend, view: MessageView, seed_offset: int) -> None:
        """Stream one reply into `view`; record it in the conversation; report failures in the view."""
        try:
            out = await self._stream_reply(backend, view, seed_offset)
        except Exception as exc:  # noqa: BLE001 - a failed reply is reported, the app keeps running
            await self._reply_failed(view, exc)
        else:
            await self._reply_done(view, out)
        finally:
            self.generating, self.request_id = False, None
            self.status.set_state("ready")

    async def _stream_reply(self, backend: ChatBackend, view: MessageView, seed_offset: int) -> RequestOutput | None:
        settings = self.conversation.settings
        window = backend.info.window
        prompt = build_prompt(backend.tokenizer, self.conversation, backend.info.prompt_format == "template",
                              window - min(settings.max_tokens, window // 2))
        if prompt.dropped:
            self.notify(f"the {prompt.dropped} oldest messages no longer fit the context window; "
                        "the model does not see them", severity="warning")
        submitted = time.perf_counter()
        self.request_id, stream = await backend.start(prompt.tokens, settings.params(prompt.stop, seed_offset))
        first: float | None = None
        last: RequestOutput | None = None
        async for out in stream:
            now = time.perf_counter()
            if first is None and out.completion_tokens:
                first = now
            await view.append(out.text)
            self._update_stats(out, submitted, first, now)
            last = out
        self.last_output = last
        return last

    def _update_stats(self, out: RequestOutput, submitted: float, first: float | None, now: float) -> None:
        tokens = out.completion_tokens
        tps, ttft = 0.0, None
        if first is not None:
            ttft = first - submitted
            if tokens > 1 and now > first:
                tps = (tokens - 1) / (now - first)
        if out.finished and out.metrics:
            tpot = out.metrics.get("tpot_s")
            tps = 1.0 / tpot if tpot else tps
            ttft = out.metrics.get("ttft_s", ttft)
        reason = (out.finish_reason or "") if out.finished else "streaming"
        self.reply_stats = ReplyStats(tps, ttft, out.prompt_tokens + tokens, tokens, reason)
        self.status.set_stats(self.reply_stats)

    async def _reply_done(self, view: MessageView, out: RequestOutput | None) -> None:
        reason = out.finish_reason if out is not None else "abort"
        meta = {"finish_reason": reason, "tokens": out.completion_tokens if out else 0,
                "tokens_per_s": round(self.reply_stats.tokens_per_s, 2)}
        message = Message("assistant", view.text, meta)
        self.conversation.messages.append(message)
        view.message = message
        note = FINISH_NOTES.get(reason or "", "")
        if not view.text and reason != "abort":
            note = "the model gave an empty reply. Ctrl+R regenerates it."
        await view.finish(note)
        self.save()

    async def _reply_failed(self, view: MessageView, exc: BaseException) -> None:
        await view.finish()
        if not view.text:
            await view.remove()
        hint = ("Ctrl+R retries; Ctrl+N starts a new chat." if isinstance(exc, TwinferError) else
                "This looks like a twinfer bug; please report it. Ctrl+R retries.")
        await self.add_note("error", f"generation failed: {describe_error(exc)}\n\n{hint}")

    # -- actions -------------------------------------------------------------------------------------
    def action_stop(self) -> None:
        """Esc: abort the streaming reply; the engine frees its KV and the stream ends with "abort"."""
        if self.generating and self.request_id is not None and self.backend is not None:
            self.backend.abort(self.request_id)

    async def action_regenerate(self) -> None:
        if self.generating:
            self.notify("a reply is still streaming: press Esc first", severity="warning")
            return
        if self.backend is None:
            self.notify("no model is loaded", severity="error")
            return
        last = self.conversation.last_reply
        if last is not None:
            self.conversation.messages.pop()
            view = self.view_of(last)
            if view is not None:
                await view.remove()
        if not self.conversation.messages:
            self.notify("nothing to regenerate yet: send a message first", severity="warning")
            return
        self._regenerations += 1
        await self.start_reply(seed_offset=self._regenerations)

    async def action_new_chat(self) -> None:
        await self._abort_and_wait()
        self.save()
        fresh = Conversation(system=self.conversation.system, settings=self.conversation.settings,
                             model=self.conversation.model)
        await self.show_conversation(fresh)
        self.query_one(ChatInput).focus()

    async def _abort_and_wait(self) -> None:
        if self.generating:
            self.action_stop()
            for _ in range(200):  # the aborted stream ends within a step or two
                if not self.generating:
                    break
                await asyncio.sleep(0.01)

    def action_copy_reply(self) -> None:
        last = self.conversation.last_reply
        if last is None or not last.content:
            self.notify("there is no reply to copy yet", severity="warning")
            return
        self.copy_to_clipboard(last.content)
        self.notify(f"copied the last reply ({len(last.content)} characters) to the clipboard")

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(self.conversation.settings, self.conversation.system), self._apply_settings)

    def _apply_settings(self, result: SettingsResult | None) -> None:
        if result is None:
            return
        self.conversation.settings, self.conversation.system = result.settings, result.system
        s = result.settings
        self.notify(f"temperature {s.temperature:g}, top-p {s.top_p:g}, max tokens {s.max_tokens}"
                    + (f", seed {s.seed}" if s.seed is not None else ""))
        self.save()

    def action_open(self) -> None:
        self.push_screen(OpenScreen(self.store.list(), str(self.store.root)), self._open_saved)

    async def _open_saved(self, conversation_id: str | None) -> None:
        if conversation_id is None:
            return
        await self._abort_and_wait()
        self.save()
        try:
            conversation = self.store.load(conversation_id)
        except TwinferError as exc:
            await self.add_note("error", f"could not open the conversation: {exc}")
            return
        if self.backend is not None:
            conversation.model = self.backend.info.name
        await self.show_conversation(conversation)
        self.notify(f"opened {conversation.title!r} ({len(conversation.messages)} messages)")
