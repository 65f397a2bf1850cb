"""`twinfer chat` driven by Textual's pilot against the real default model (Gemma 3 270M, llama.cpp).

Each test loads the model in its own app (about a second) and keeps replies short; one llama.cpp
thread, since these machines are shared and an oversubscribed llama.cpp slows down many times over.
Stubbed, model-free tests of the same app (and the layout snapshot) are in test_tui_parts.py.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Coroutine
from pathlib import Path

import pytest

from twinfer.tui.app import ChatApp, ChatOptions
from twinfer.tui.backend import EngineBackend, LoadOptions
from twinfer.tui.conversation import ConversationStore, Settings
from twinfer.tui.dialogs import SettingsScreen
from twinfer.tui.widgets import ChatInput, MessageView

pytest.importorskip("llama_cpp")

LONG_PROMPT = "List the numbers from 1 to 300, separated by commas."  # the default model counts on and on


def run_async(fn: Callable[..., Coroutine[None, None, None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> None:
        asyncio.run(fn(*args, **kwargs))
    return wrapper


def chat_app(tmp_path: Path, model: str | None = None, **settings: object) -> ChatApp:
    options = ChatOptions(LoadOptions(model=model, ctx=1024, threads=1),
                          settings=Settings(**{"max_tokens": 32, "seed": 1, **settings}))
    return ChatApp(options, store=ConversationStore(tmp_path / "conversations"))


async def wait_for(pilot, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out waiting for the app"
        await pilot.pause(0.02)


async def loaded(pilot, app: ChatApp) -> EngineBackend:
    await wait_for(pilot, lambda: app.backend is not None or app.load_error is not None)
    assert app.load_error is None, app.load_error
    assert isinstance(app.backend, EngineBackend)
    return app.backend


async def ask(pilot, app: ChatApp, text: str) -> None:
    app.query_one(ChatInput).insert(text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: not app.generating and app.conversation.last_reply is not None)


def replies(app: ChatApp) -> list[MessageView]:
    return [v for v in app.query(MessageView) if v.role == "assistant"]


@run_async
async def test_typed_prompt_streams_a_reply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    original = MessageView.append

    async def spy(self: MessageView, fragment: str) -> None:
        seen.append(fragment)
        await original(self, fragment)

    monkeypatch.setattr(MessageView, "append", spy)
    app = chat_app(tmp_path)
    async with app.run_test(size=(110, 34)) as pilot:
        await loaded(pilot, app)
        await pilot.press(*"What is the capital of France?")
        assert app.query_one(ChatInput).text == "What is the capital of France?"
        await pilot.press("enter")
        assert app.query_one(ChatInput).text == ""
        await wait_for(pilot, lambda: not app.generating and app.conversation.last_reply is not None)
        reply = app.conversation.last_reply
        assert reply is not None and reply.content.strip()
        assert len([s for s in seen if s]) >= 2  # streamed in pieces, not all at once
        assert "".join(seen).strip() == reply.content == replies(app)[-1].text
        assert reply.meta["finish_reason"] in ("stop", "length") and reply.meta["tokens"] > 0
        saved = ConversationStore(tmp_path / "conversations").load(app.conversation.id)
        assert [m.content for m in saved.messages] == ["What is the capital of France?", reply.content]


@run_async
async def test_escape_stops_a_long_reply_and_frees_the_request(tmp_path: Path) -> None:
    app = chat_app(tmp_path, max_tokens=2000, seed=2)
    async with app.run_test(size=(110, 34)) as pilot:
        backend = await loaded(pilot, app)
        app.query_one(ChatInput).insert(LONG_PROMPT)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.reply_stats.completion_tokens >= 8)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating, timeout=10)
        out = app.last_output
        assert out is not None and out.finish_reason == "abort"
        assert 8 <= out.completion_tokens < 300  # stopped early, far from max_tokens
        await wait_for(pilot, lambda: backend.running == 0, timeout=5)
        engine = backend.engine.engine
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert not engine.blocks.seqs  # no sequence holds KV blocks any more
        assert "stopped (Esc)" in str(replies(app)[-1].query_one(".note").render())
        assert app.conversation.last_reply.meta["finish_reason"] == "abort"


@run_async
async def test_regenerate_replaces_the_last_reply(tmp_path: Path) -> None:
    app = chat_app(tmp_path, max_tokens=24)
    async with app.run_test(size=(110, 34)) as pilot:
        await loaded(pilot, app)
        await ask(pilot, app, "Name a fruit.")
        first, first_view = app.conversation.last_reply, replies(app)[-1]
        assert first is not None and first_view.text == first.content
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.generating and app.conversation.last_reply is not first)
        second = app.conversation.last_reply
        assert second is not None and second is not first
        assert [m.role for m in app.conversation.messages] == ["user", "assistant"]
        assert [v.text for v in replies(app)] == [second.content]  # the old reply's view is gone
        assert not first_view.is_attached
        saved = ConversationStore(tmp_path / "conversations").load(app.conversation.id)
        assert [m.content for m in saved.messages] == ["Name a fruit.", second.content]


@run_async
async def test_status_panel_shows_speed_after_a_reply(tmp_path: Path) -> None:
    app = chat_app(tmp_path, max_tokens=16)
    async with app.run_test(size=(110, 34)) as pilot:
        backend = await loaded(pilot, app)
        status = app.status.plain()
        assert "tokens/s -" in status and "state ready" in status
        assert "backend llamacpp" in status and "weights Q4_K_M" in status and "memory " in status
        await ask(pilot, app, "Tell me about the moon.")
        status = app.status.plain()
        tps = float(re.search(r"tokens/s (\S+)", status).group(1))
        ttft_ms = float(re.search(r"TTFT (\d+) ms", status).group(1))
        used, window = map(int, re.search(r"context (\d+) / (\d+)", status).groups())
        assert tps > 0 and ttft_ms > 0
        assert window == backend.info.window == 1024
        out = app.last_output
        assert used == out.prompt_tokens + out.completion_tokens > out.prompt_tokens
    assert not backend.engine.alive  # quitting stops the engine thread


@run_async
async def test_missing_model_shows_an_error_and_the_app_stays_usable(tmp_path: Path) -> None:
    app = chat_app(tmp_path, model=str(tmp_path / "no-such-model.gguf"))
    async with app.run_test(size=(110, 34)) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None, timeout=10)
        assert app.backend is None
        errors = [v.text for v in app.query(MessageView) if v.role == "error"]
        assert len(errors) == 1 and "does not exist" in errors[0] and "twinfer chat PATH" in errors[0]
        assert "state no model loaded" in app.status.plain()
        await pilot.press(*"hello")
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one(ChatInput).text == "hello"  # kept, nobody could answer it
        assert "no model is loaded" in [v.text for v in app.query(MessageView) if v.role == "error"][-1]
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, SettingsScreen)
        assert app.is_running
