"""A chat's state and its file: messages, system prompt and sampling settings, saved as JSON under
`<data dir>/conversations/` (`TWINFER_DATA_DIR` or platformdirs' user data dir)."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twinfer.runtime.engine import SamplingParams
from twinfer.runtime.errors import TwinferError

DATA_DIR_ENV = "TWINFER_DATA_DIR"
DEFAULT_SYSTEM = "You are a helpful assistant."
ROLES = ("user", "assistant")


@dataclass(frozen=True)
class Settings:
    """The sampling settings a user edits in the dialog (and on the command line)."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512
    top_k: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        self.params()  # SamplingParams checks the ranges and words the error

    def params(self, stop: tuple[str, ...] = (), seed_offset: int = 0) -> SamplingParams:
        """Engine parameters; `seed_offset` gives a regenerated reply a different (still fixed) seed."""
        seed = None if self.seed is None else self.seed + seed_offset
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, stop=stop)


@dataclass
class Message:
    role: str  # "user" or "assistant"
    content: str
    meta: dict[str, Any] = field(default_factory=dict)  # assistant: finish_reason, tokens, tokens_per_s

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TwinferError(f"message role must be one of {', '.join(ROLES)}, got {self.role!r}")


def new_id() -> str:
    """Sortable and unique: creation time, then random hex."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass
class Conversation:
    system: str = DEFAULT_SYSTEM
    messages: list[Message] = field(default_factory=list)
    settings: Settings = field(default_factory=Settings)
    model: str = ""
    id: str = field(default_factory=new_id)
    created: float = field(default_factory=time.time)

    @property
    def title(self) -> str:
        first = next((m.content for m in self.messages if m.role == "user"), "")
        line = " ".join(first.split())
        return (line[:57] + "...") if len(line) > 60 else (line or "(empty)")

    @property
    def last_reply(self) -> Message | None:
        return self.messages[-1] if self.messages and self.messages[-1].role == "assistant" else None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1, "id": self.id, "created": self.created, "model": self.model, "system": self.system,
            "settings": asdict(self.settings), "messages": [asdict(m) for m in self.messages],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Conversation:
        try:
            settings = Settings(**data.get("settings", {}))
            messages = [Message(m["role"], str(m["content"]), dict(m.get("meta", {}))) for m in data["messages"]]
            return cls(system=str(data.get("system", DEFAULT_SYSTEM)), messages=messages, settings=settings,
                       model=str(data.get("model", "")), id=str(data["id"]),
                       created=float(data.get("created", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise TwinferError(f"not a twinfer conversation file ({exc!r}); it may be from a newer version") from None


@dataclass(frozen=True)
class SavedInfo:
    id: str
    title: str
    model: str
    modified: float
    turns: int


class ConversationStore:
    """Reads and writes conversation files in one folder (created on the first save)."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_root()

    def path(self, conversation_id: str) -> Path:
        if not conversation_id or any(c in conversation_id for c in "/\\") or conversation_id.startswith("."):
            raise TwinferError(f"bad conversation id {conversation_id!r}")
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> Path:
        """Write atomically (a crash mid-save keeps the previous file)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(conversation.id)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(conversation.to_json(), indent=1, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)
        return path

    def load(self, conversation_id: str) -> Conversation:
        """A saved conversation by id; "last" means the most recently saved one."""
        if conversation_id == "last":
            saved = self.list()
            if not saved:
                raise TwinferError(f"there are no saved conversations in {self.root} yet")
            conversation_id = saved[0].id
        path = self.path(conversation_id)
        if not path.exists():
            raise TwinferError(f"no saved conversation {conversation_id!r} in {self.root}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TwinferError(f"cannot read {path}: {exc}") from None
        return Conversation.from_json(data)

    def list(self) -> list[SavedInfo]:
        """Saved conversations, newest first; unreadable files are skipped."""
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.glob("*.json"):
            try:
                c = Conversation.from_json(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TwinferError):
                continue
            out.append(SavedInfo(c.id, c.title, c.model, path.stat().st_mtime, len(c.messages)))
        return sorted(out, key=lambda s: (s.modified, s.id), reverse=True)


def default_root() -> Path:
    base = os.environ.get(DATA_DIR_ENV)
    if not base:
        import platformdirs

        base = platformdirs.user_data_dir("twinfer")
    return Path(base).expanduser() / "conversations"
