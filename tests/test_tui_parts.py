"""The chat app's parts without a model: prompts, the conversation store, dialogs, error paths, and
the layout snapshot, with a stub backend so every screen is deterministic.

The pilot tests against the real default model are in test_tui.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path

import pytest

from twinfer.runtime.engine import RequestOutput, SamplingParams
from twinfer.runtime.errors import PlanError, RequestError, TwinferError
from twinfer.tui.app import ChatApp, ChatOptions
from twinfer.tui.backend import LoadOptions, ModelInfo, PlanSummary, Progress
from twinfer.tui.conversation import Conversation, ConversationStore, Message, Settings
from twinfer.tui.dialogs import OpenScreen, SettingsScreen
from twinfer.tui.prompt import TRANSCRIPT_STOPS, build_prompt, chat_messages, transcript
from twinfer.tui.widgets import ChatInput, MessageView

INFO = ModelInfo("Stub 1B", "/models/stub.gguf", "stub · cpu", 2048, "transcript",
                 PlanSummary("Q4_K_M (as stored)", "Q8_0 (8.5 bits)", "1.2 GB of 16.0 GB", "dense", "Test CPU"))


class CharTokenizer:
    """One token per character; enough for prompt-length arithmetic."""

    chat_template = "stub"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


class StubBackend:
    """Streams `pieces`, then finishes with `finish_reason`; `fail` makes `start` raise it instead."""

    def __init__(self, pieces: tuple[str, ...] = ("Hello", " there", "!"), finish_reason: str = "stop",
                 fail: Exception | None = None):
        self.info = INFO
        self.tokenizer = CharTokenizer()
        self.pieces, self.finish_reason, self.fail = pieces, finish_reason, fail
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.closed = False

    async def start(self, tokens: list[int], params: SamplingParams) -> tuple[str, AsyncIterator[RequestOutput]]:
        if self.fail is not None:
            raise self.fail
        self.prompts.append(tokens)
        self.params.append(params)
        return f"stub-{len(self.prompts)}", self._stream(len(tokens))

    async def _stream(self, prompt_tokens: int) -> AsyncIterator[RequestOutput]:
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield RequestOutput("stub", piece, [i], last, self.finish_reason if last else None,
                                prompt_tokens=prompt_tokens, completion_tokens=i + 1,
                                metrics={"ttft_s": 0.05, "tpot_s": 0.02} if last else {})
            await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        pass

    @property
    def running(self) -> int:
        return 0

    async def close(self) -> None:
        self.closed = True


def stub_loader(backend: StubBackend):
    def load(options: LoadOptions, progress: Progress) -> StubBackend:
        progress(0, 1, "stub")
        return backend
    return load


def run_async(fn: Callable[..., Coroutine[None, None, None]]) -> Callable[..., None]:
    """Run an async test body with asyncio.run (no pytest async plugin needed)."""
    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> None:
        asyncio.run(fn(*args, **kwargs))
    return wrapper


async def ready(pilot, app: ChatApp) -> None:
    for _ in range(400):
        if app.backend is not None or app.load_error is not None:
            break
        await pilot.pause(0.01)
    await pilot.pause()


async def until_idle(pilot, app: ChatApp) -> None:
    await pilot.pause()
    for _ in range(400):
        if not app.generating:
            break
        await pilot.pause(0.01)
    await pilot.pause()


async def send(pilot, app: ChatApp, text: str) -> None:
    app.query_one(ChatInput).insert(text)
    await pilot.press("enter")
    await until_idle(pilot, app)


# -- prompts -------------------------------------------------------------------------------------------
def test_transcript_format_and_stops() -> None:
    msgs = [Message("user", "Hi"), Message("assistant", " Hello!\n"), Message("user", "Name a color.")]
    assert transcript("Be brief.", msgs) == "Be brief.\n\nUser: Hi\nAssistant: Hello!\nUser: Name a color.\nAssistant:"
    assert transcript("", msgs[:1]) == "User: Hi\nAssistant:"
    conv = Conversation(system="Be brief.", messages=msgs)
    prompt = build_prompt(CharTokenizer(), conv, use_template=False, budget=1000)
    assert "".join(map(chr, prompt.tokens)) == transcript("Be brief.", msgs)
    assert prompt.stop == (*TRANSCRIPT_STOPS, "\nBe brief.") and prompt.dropped == 0


def test_template_merges_repeated_roles_and_drops_oldest_turns() -> None:
    msgs = [Message("user", "a" * 50), Message("assistant", "b" * 50), Message("user", "c"), Message("user", "d")]
    assert chat_messages("S", msgs)[1:] == [
        {"role": "user", "content": "a" * 50}, {"role": "assistant", "content": "b" * 50},
        {"role": "user", "content": "c\n\nd"}]
    conv = Conversation(system="S", messages=msgs)
    full = build_prompt(CharTokenizer(), conv, use_template=True, budget=1000)
    short = build_prompt(CharTokenizer(), conv, use_template=True, budget=60)
    assert full.dropped == 0 and full.stop == ()
    assert short.dropped == 2  # the user message, then the assistant reply that would lead the history
    assert "".join(map(chr, short.tokens)) == "<system>S<user>c\n\nd<assistant>"
    with pytest.raises(RequestError, match="context window"):
        build_prompt(CharTokenizer(), Conversation(messages=[Message("user", "x" * 100)]), False, 50)


def test_a_model_that_does_not_fit_is_refused_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    from twinfer.tui import backend as backend_mod

    refused = PlanSummary("-", "-", "-", "-", "Tiny CPU", fits=False, suggestion="use --format q4_k_m")
    monkeypatch.setattr(backend_mod, "plan_summary", lambda path, ctx: refused)
    steps: list[str] = []
    with pytest.raises(PlanError, match=r"does not fit .* use --format q4_k_m .*twinfer plan"):
        backend_mod.load_backend(LoadOptions(), lambda step, total, what: steps.append(what))
    assert steps[0] == "finding the model" and steps[-1].startswith("planning")


# -- the store -------------------------------------------------------------------------------------------
def test_store_round_trip_list_and_last(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c")
    assert store.list() == []
    with pytest.raises(TwinferError, match="no saved conversations"):
        store.load("last")
    a = Conversation(system="sys", settings=Settings(temperature=0.3, max_tokens=9, seed=4), model="m", id="a")
    a.messages += [Message("user", "héllo"), Message("assistant", "hi", {"finish_reason": "stop"})]
    store.save(a)
    b = Conversation(id="b", messages=[Message("user", "second")])
    path = store.save(b)
    assert json.loads(path.read_text())["messages"][0]["content"] == "second"
    assert store.load("a") == a
    assert [s.id for s in store.list()] in (["b", "a"], ["a", "b"])  # same-second mtimes tie
    assert store.load("last").id == store.list()[0].id
    (tmp_path / "c" / "broken.json").write_text("{")
    assert len(store.list()) == 2
    with pytest.raises(TwinferError, match="bad conversation id"):
        store.path("../escape")


def test_store_default_root_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINFER_DATA_DIR", str(tmp_path))
    assert ConversationStore().root == tmp_path / "conversations"


def test_settings_validate() -> None:
    with pytest.raises(RequestError, match="top_p"):
        Settings(top_p=0.0)
    assert Settings(seed=5).params(("x",), seed_offset=2).seed == 7


# -- the app with a stub backend ---------------------------------------------------------------------------
def make_app(tmp_path: Path, backend: StubBackend, **kw) -> ChatApp:
    return ChatApp(ChatOptions(**kw), store=ConversationStore(tmp_path), loader=stub_loader(backend))


@run_async
async def test_reply_is_recorded_saved_and_copied(tmp_path: Path) -> None:
    backend = StubBackend()
    app = make_app(tmp_path, backend)
    async with app.run_test() as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Hi")
        assert [(m.role, m.content) for m in app.conversation.messages] == [("user", "Hi"), ("assistant", "Hello there!")]
        assert "".join(map(chr, backend.prompts[0])).endswith("User: Hi\nAssistant:")
        assert backend.params[0].stop == (*TRANSCRIPT_STOPS, "\nYou are a helpful assistant.")
        assert ConversationStore(tmp_path).load(app.conversation.id).messages[-1].content == "Hello there!"
        await pilot.press("ctrl+l")
        assert app.clipboard == "Hello there!"
        assert "tokens/s 50.0" in app.status.plain() and "TTFT 50 ms" in app.status.plain()
    assert backend.closed


@run_async
async def test_input_keys_newline_multiline_and_send(tmp_path: Path) -> None:
    backend = StubBackend()
    app = make_app(tmp_path, backend)
    async with app.run_test() as pilot:
        await ready(pilot, app)
        box = app.query_one(ChatInput)
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        assert box.text == "a\nb\nc" and not backend.prompts
        await pilot.press("ctrl+t", "enter", "d")  # multiline mode: Enter is a newline
        assert box.text == "a\nb\nc\nd" and box.multiline and "Alt+Enter send" in str(box.border_title)
        await pilot.press("alt+enter")
        await until_idle(pilot, app)
        assert app.conversation.messages[0].content == "a\nb\nc\nd" and box.text == ""
        await pilot.press("ctrl+t", "x", "enter")  # back to Enter sends
        await until_idle(pilot, app)
        assert [m.content for m in app.conversation.messages if m.role == "user"] == ["a\nb\nc\nd", "x"]


@run_async
async def test_loop_guard_and_failures_become_messages(tmp_path: Path) -> None:
    backend = StubBackend(pieces=("la", " la", " la"), finish_reason="loop")
    app = make_app(tmp_path, backend)
    async with app.run_test() as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Sing")
        reply = app.query(MessageView).last()
        assert reply.role == "assistant" and "loop guard" in reply.query_one(".note").render().plain
        backend.fail = RequestError("the prompt has 9000 tokens but the context window is 4096: shorten it")
        await send(pilot, app, "Again")
        error = app.query(MessageView).last()
        assert error.role == "error" and "shorten it" in error.text and "Ctrl+R retries" in error.text
        backend.fail = None
        await pilot.press("ctrl+r")  # the failed turn is retried
        await until_idle(pilot, app)
        assert [m.role for m in app.conversation.messages] == ["user", "assistant", "user", "assistant"]


@run_async
async def test_settings_dialog_validates_and_applies(tmp_path: Path) -> None:
    app = make_app(tmp_path, StubBackend())
    async with app.run_test() as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#temperature").value = "-1"
        await pilot.click("#save")
        assert "temperature must be in" in str(screen.query_one("#settings-error").render())
        screen.query_one("#temperature").value = "0.2"
        screen.query_one("#max_tokens").value = "33"
        screen.query_one("#seed").value = "11"
        screen.query_one("#system").text = "Talk like a pirate."
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen), screen.query_one("#settings-error").render()
        assert app.conversation.settings == Settings(temperature=0.2, max_tokens=33, seed=11)
        assert app.conversation.system == "Talk like a pirate."


@run_async
async def test_new_chat_and_reopen_saved(tmp_path: Path) -> None:
    app = make_app(tmp_path, StubBackend())
    async with app.run_test() as pilot:
        await ready(pilot, app)
        await send(pilot, app, "First chat")
        first_id = app.conversation.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.conversation.messages == [] and app.conversation.id != first_id
        assert not [v for v in app.query(MessageView) if v.role in ("user", "assistant")]
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, OpenScreen)
        await pilot.press("enter")  # the newest (and only) saved conversation
        await pilot.pause()
        assert app.conversation.id == first_id
        assert [v.text for v in app.query(MessageView) if v.role != "info"] == ["First chat", "Hello there!"]


@run_async
async def test_app_stays_responsive_while_loading(tmp_path: Path) -> None:
    gate = threading.Event()
    backend = StubBackend()

    def slow_loader(options: LoadOptions, progress: Progress) -> StubBackend:
        progress(2, 4, "loading stub.gguf on stub")
        assert gate.wait(10)
        return backend

    app = ChatApp(ChatOptions(), store=ConversationStore(tmp_path), loader=slow_loader)
    async with app.run_test() as pilot:
        for _ in range(200):
            if "loading stub.gguf" in str(app.query_one("#loading-label").render()):
                break
            await pilot.pause(0.01)
        assert str(app.query_one("#loading-label").render()) == "[3/5] loading stub.gguf on stub..."
        assert "state loading" in app.status.plain()
        await pilot.press("h", "i", "enter")  # typing works; sending waits for the model
        assert app.query_one(ChatInput).text == "hi" and app.conversation.messages == []
        gate.set()
        await ready(pilot, app)
        assert not app.query("#loading") and "state ready" in app.status.plain()
        await pilot.press("enter")
        await until_idle(pilot, app)
        assert [m.content for m in app.conversation.messages] == ["hi", "Hello there!"]


def test_chat_help_documents_every_option() -> None:
    from typer.testing import CliRunner

    from twinfer.cli.main import app

    result = CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    for option in ("--backend", "--system", "--temperature", "--top-p", "--max-tokens", "--seed", "--ctx",
                   "--threads", "--template", "--resume", "--data-dir"):
        line = next(line for line in lines if f" {option} " in line)
        assert len(line.split(option, 1)[1].strip(" │")) > 20, f"{option} has no help text"


# -- the layout snapshot -----------------------------------------------------------------------------------
def test_main_layout_snapshot(snap_compare, tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    saved = Conversation(id="snapshot", model=INFO.name, messages=[
        Message("user", "What does **twinfer** do?"),
        Message("assistant", "It runs a model **fast**:\n\n- on a laptop: compress to fit\n- on a GPU server: "
                             "native formats\n\n```\ntwinfer plan\n```"),
        Message("user", "Thanks!"),
        Message("assistant", "You're", {"finish_reason": "abort"}),
    ])
    store.save(saved)
    app = ChatApp(ChatOptions(resume="snapshot"), store=store, loader=stub_loader(StubBackend()))

    async def loaded(pilot) -> None:
        await ready(pilot, app)
        app.query_one(ChatInput).cursor_blink = False

    assert snap_compare(app, terminal_size=(110, 34), run_before=loaded)
