"""Chat templates: render a list of messages into the prompt text a model was trained on.
Jinja in a sandbox set up exactly as transformers sets it up, so a template renders as
`apply_chat_template(..., tokenize=False)` does. Messages are validated (`RequestError`) and
normalized first (docs/internals.md, "Chat templates"); no template: `FALLBACK_TEMPLATE` (ChatML)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from twinfer.runtime.errors import ModelError, RequestError

ROLES = ("system", "user", "assistant", "tool")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_MEDIA = {"image", "video", "audio"}  # a word of a media part's type

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def builtin_template(architecture: str) -> str | None:
    """The chat template an architecture's file declares (`Architecture.chat_template`) for model files
    that carry none; `architecture` is a GGUF `general.architecture` or a model_type. None if unknown."""
    from twinfer.runtime.models import architecture as by_model_type
    from twinfer.runtime.models import gguf_architecture

    arch = gguf_architecture(architecture) or by_model_type(architecture)
    return arch.chat_template if arch is not None else None


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template` (None: `FALLBACK_TEMPLATE`) as transformers would, `extra` passed
    to it; RequestError for bad messages or a template's refusal, ModelError for a broken template."""
    chat = validate_messages(messages)
    compiled = _compile(template if template is not None else FALLBACK_TEMPLATE)
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **_plain(extra),
        )
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template rejected these messages: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise RequestError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from e


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checked, plain-data copies of chat messages in the form templates expect (see module doc)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise RequestError("messages is empty; send at least one message")
    return [_validate_message(i, m) for i, m in enumerate(messages)]


def _validate_message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise RequestError(
            f"{where} must be an object with 'role' and 'content', got {type(message).__name__}"
        )
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role is {role!r}; it must be one of {', '.join(ROLES)}")
    out: dict[str, Any] = _plain(dict(message))
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise RequestError(f"{where}.tool_calls is only allowed on assistant messages, not {role!r}")
        out["tool_calls"] = _validate_tool_calls(where, tool_calls)
    content = message.get("content")
    if content is None:
        if not (role == "assistant" and tool_calls):
            raise RequestError(
                f"{where}.content is missing; only an assistant message with tool_calls may omit it"
            )
    else:
        out["content"] = _content_text(where, content)
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RequestError(f"{where}: reasoning must be a string, got {type(reasoning).__name__}")
        out.update(dict.fromkeys(_REASONING_FIELDS, reasoning))
    return out


def _content_text(where: str, content: Any) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with images, the list of text and {"type": "image"} parts (a
    decoded image's place, which the template renders as the model's image marker)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise RequestError(
            f"{where}.content must be a string or a list of text parts, got {type(content).__name__}"
        )
    texts, parts = [], []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "image":
            parts.append({"type": "image"})
            continue
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if isinstance(kind, str) and _MEDIA & set(kind.split("_")):  # image_url, input_image, input_audio...
                raise RequestError(f"{where}.content[{j}] has type {kind!r}: audio and video are not supported, "
                                   "and images reach the template decoded, as {'type': 'image'} parts")
            raise RequestError(f"{where}.content[{j}] has type {kind!r}; only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{j}].text must be a string")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _validate_tool_calls(where: str, tool_calls: Any) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, (str, bytes)):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(
                f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise RequestError(
                    f"{where}.tool_calls[{j}].function.arguments is not valid JSON: {e}"
                ) from e
        out.append(_plain({**call, "function": fn}))
    return out


def _plain(value: Any) -> Any:
    """A copy made of JSON types only: the sandbox then sees no objects with methods of their own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    # Subclasses (enums, numpy scalars) are cut back to the base type, so they lose their methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "item", None)):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as transformers' does (no reaching into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes; transformers' does not and exposes json.dumps' options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"the model's chat template does not compile (line {e.lineno}: {e.message})") from e
