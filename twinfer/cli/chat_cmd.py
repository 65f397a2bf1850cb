"""`twinfer chat`: the Textual chat app for one model."""

from __future__ import annotations

from pathlib import Path

from twinfer.runtime.errors import TwinferError


def run_chat(model: str | None, backend: str, system: str | None, temperature: float, top_p: float,
             max_tokens: int, seed: int | None, ctx: int, threads: int | None, template: bool | None,
             resume: str | None, data_dir: str | None, budget: tuple[str | None, bool] = (None, False),
             speculate: str = "off") -> None:
    from twinfer.runtime.speculative.options import parse_speculate
    from twinfer.tui.app import ChatApp, ChatOptions
    from twinfer.tui.backend import LoadOptions
    from twinfer.tui.conversation import DEFAULT_SYSTEM, ConversationStore, Settings

    if ctx < 64:
        raise TwinferError(f"--ctx must be at least 64 tokens, got {ctx}")
    if threads is not None and threads < 1:
        raise TwinferError(f"--threads must be at least 1, got {threads}")
    settings = Settings(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    store = ConversationStore(Path(data_dir).expanduser() / "conversations" if data_dir else None)
    if resume:
        store.load(resume)  # a bad id is a one-line error before the screen opens
    if budget[0] is not None:
        from twinfer.app.budget import parse_budget

        parse_budget(budget[0])  # a typo fails before the screen opens
    parse_speculate(speculate)  # and so does a typo here
    options = ChatOptions(LoadOptions(model, backend, ctx, threads, template, budget[0], budget[1], speculate),
                          DEFAULT_SYSTEM if system is None else system, settings, resume)
    ChatApp(options, store=store).run()
