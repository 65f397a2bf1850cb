"""Regenerate the README screenshot (`python -m twinfer.tui.screenshot docs/tui.svg`): a real
conversation with the default model, fixed seed, one thread, in a temporary data dir."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from twinfer.tui.app import ChatApp, ChatOptions
from twinfer.tui.backend import LoadOptions
from twinfer.tui.conversation import ConversationStore, Settings
from twinfer.tui.widgets import ChatInput

PROMPTS = ("What is the capital of France?", "Tell me about the moon.")


async def capture(out: Path, prompts: tuple[str, ...] = PROMPTS, size: tuple[int, int] = (120, 36),
                  seed: int = 1) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        options = ChatOptions(LoadOptions(threads=1), settings=Settings(max_tokens=96, seed=seed))
        app = ChatApp(options, store=ConversationStore(tmp))
        async with app.run_test(size=size) as pilot:
            while app.backend is None and app.load_error is None:
                await pilot.pause(0.05)
            if app.load_error is not None:
                raise SystemExit(f"could not load the default model: {app.load_error}")
            for prompt in prompts:
                app.query_one(ChatInput).insert(prompt)
                await pilot.press("enter")
                await pilot.pause(0.1)
                while app.generating:
                    await pilot.pause(0.05)
            await pilot.pause(0.2)
            app.save_screenshot(filename=out.name, path=str(out.parent))


def main(argv: list[str]) -> None:
    out = Path(argv[1] if len(argv) > 1 else "docs/tui.svg")
    out.parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(capture(out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
