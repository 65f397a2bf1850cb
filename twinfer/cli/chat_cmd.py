"""`twinfer chat`: the Textual chat app for one model."""

from __future__ import annotations

from pathlib import Path

from twinfer.tui.app import ChatOptions


def run_chat(options: ChatOptions, data_dir: str | None = None) -> None:
    """Open the chat screen; `data_dir` holds saved conversations (None: the user data dir)."""
    from twinfer.tui.app import ChatApp
    from twinfer.tui.conversation import ConversationStore

    store = ConversationStore(Path(data_dir).expanduser() / "conversations" if data_dir else None)
    if options.resume:
        store.load(options.resume)  # a bad id is a one-line error before the screen opens
    ChatApp(options, store=store).run()
