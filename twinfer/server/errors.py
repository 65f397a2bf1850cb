"""OpenAI-style error objects ({"error": {"message", "type", "param", "code"}}): every rejection goes
through `APIError`, with a message that says what was wrong and what to do."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


class APIError(Exception):
    """A request the server answers with `status` and an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_body(message, type, param, code)).encode()


def from_validation(errors: Sequence[Any]) -> APIError:
    """A 400 from pydantic/FastAPI validation errors: the first error, with its field as `param`."""
    if not errors:
        return APIError(400, "the request body is invalid")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(400, f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}",
                        code="invalid_json")
    if kind == "missing" and not loc:
        return APIError(400, "the request needs a JSON body", code="invalid_json")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return APIError(400, "the request body must be a JSON object (send it with Content-Type: application/json)",
                        code="invalid_json")
    param = _dotted(loc) or None
    where = f"'{param}'" if param else "the request body"
    extra = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    message = f"{where}: {first.get('msg', 'invalid value')}{extra}"
    return APIError(400, message, param=param, code="invalid_value" if kind != "missing" else "missing_required_parameter")


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out
