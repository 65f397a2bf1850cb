"""Modal dialogs: sampling settings (+ system prompt) and reopening a saved conversation."""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, TextArea
from textual.widgets.option_list import Option

from twinfer.runtime.errors import TwinferError
from twinfer.tui.conversation import SavedInfo, Settings


@dataclass(frozen=True)
class SettingsResult:
    settings: Settings
    system: str


class SettingsScreen(ModalScreen[SettingsResult | None]):
    """Temperature, top-p, max tokens, seed and the system prompt. Esc cancels, Ctrl+S saves."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, settings: Settings, system: str) -> None:
        super().__init__()
        self.settings = settings
        self.system = system

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="settings", classes="dialog"):
            yield Label("Sampling settings", classes="dialog-title")
            with Grid(id="settings-grid"):
                yield Label("temperature (0 = greedy)")
                yield Input(f"{s.temperature:g}", id="temperature", type="number")
                yield Label("top-p (0-1]")
                yield Input(f"{s.top_p:g}", id="top_p", type="number")
                yield Label("max tokens")
                yield Input(str(s.max_tokens), id="max_tokens", type="integer")
                yield Label("seed (empty: random)")
                yield Input("" if s.seed is None else str(s.seed), id="seed", type="integer")
            yield Label("system prompt")
            yield TextArea(self.system, id="system", soft_wrap=True)
            yield Label("", id="settings-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def on_input_submitted(self) -> None:
        self.action_save()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        try:
            settings = self.read()
        except (ValueError, TwinferError) as exc:
            self.query_one("#settings-error", Label).update(f"{exc}")
            return
        self.dismiss(SettingsResult(settings, self.query_one("#system", TextArea).text))

    def read(self) -> Settings:
        def value(name: str) -> str:
            return self.query_one(f"#{name}", Input).value.strip()

        def number(name: str, kind: type) -> float | int:
            try:
                return kind(value(name))
            except ValueError:
                raise ValueError(f"{name.replace('_', ' ')} must be a number, got {value(name)!r}") from None

        seed = int(number("seed", int)) if value("seed") else None
        return Settings(temperature=float(number("temperature", float)), top_p=float(number("top_p", float)),
                        max_tokens=int(number("max_tokens", int)), top_k=self.settings.top_k, seed=seed)


class OpenScreen(ModalScreen[str | None]):
    """Pick a saved conversation (newest first); Enter opens it, Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, saved: list[SavedInfo], folder: str) -> None:
        super().__init__()
        self.saved = saved
        self.folder = folder

    def compose(self) -> ComposeResult:
        with Vertical(id="open", classes="dialog"):
            yield Label("Open a saved conversation", classes="dialog-title")
            if not self.saved:
                yield Label(f"No saved conversations yet in {self.folder}.")
            options = [
                Option(f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(s.modified))}  {s.title}  "
                       f"({s.turns} messages, {s.model or 'unknown model'})", id=s.id)
                for s in self.saved
            ]
            yield OptionList(*options, id="saved")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_button_pressed(self) -> None:
        self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
