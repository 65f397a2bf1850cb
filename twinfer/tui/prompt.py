"""A conversation -> the prompt tokens and stop strings for its next reply: `template` (the chat
template, for chat-tuned models) or `transcript` ("User: ... Assistant:", for base models such as the
default Gemma 3 270M, which loops on its template). The oldest turns go first when the context is full."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twinfer.runtime.errors import RequestError
from twinfer.tui.conversation import Conversation, Message

TRANSCRIPT_STOPS = ("\nUser:", "\nAssistant:")
_SPEAKER = {"user": "User", "assistant": "Assistant"}


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    stop: tuple[str, ...]
    dropped: int = 0  # oldest messages left out to fit the window


def transcript(system: str, messages: Sequence[Message]) -> str:
    head = f"{system.strip()}\n\n" if system.strip() else ""
    turns = "".join(f"{_SPEAKER[m.role]}: {m.content.strip()}\n" for m in messages)
    return f"{head}{turns}Assistant:"


def transcript_stops(system: str) -> tuple[str, ...]:
    """The next role marker ends a reply; so does the system prompt's first line, which a base model
    writes out when it starts a new transcript of its own."""
    first = system.strip().splitlines()[0][:40].strip() if system.strip() else ""
    return TRANSCRIPT_STOPS + ((f"\n{first}",) if first else ())


def chat_messages(system: str, messages: Sequence[Message]) -> list[dict[str, str]]:
    """Template messages; consecutive same-role messages (a reply that failed) are merged, since
    most templates insist that roles alternate."""
    out = [{"role": "system", "content": system}] if system.strip() else []
    for m in messages:
        if len(out) > (1 if system.strip() else 0) and out[-1]["role"] == m.role:
            out[-1] = {"role": m.role, "content": f"{out[-1]['content']}\n\n{m.content}"}
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def build_prompt(tokenizer: Any, conversation: Conversation, use_template: bool, budget: int) -> Prompt:
    """Encode the conversation (ending with a user message) for its next reply in at most `budget`
    tokens; RequestError when even the last message with the system prompt does not fit."""
    messages = list(conversation.messages)
    if not messages or messages[-1].role != "user":
        raise RequestError("the conversation must end with a user message to get a reply")
    dropped = 0
    while True:
        if use_template:
            tokens = tokenizer.encode_chat(chat_messages(conversation.system, messages))
            stop: tuple[str, ...] = ()
        else:
            tokens = tokenizer.encode(transcript(conversation.system, messages))
            stop = transcript_stops(conversation.system)
        if len(tokens) <= budget:
            return Prompt(tokens, stop, dropped)
        if len(messages) == 1:
            raise RequestError(
                f"the message needs {len(tokens)} tokens but only {budget} fit in the context window: "
                "shorten it, shorten the system prompt, or restart with a larger --ctx"
            )
        messages, dropped = messages[1:], dropped + 1
        while messages[0].role != "user":  # a history starts with the user (templates check)
            messages, dropped = messages[1:], dropped + 1
