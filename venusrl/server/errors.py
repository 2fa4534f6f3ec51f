"""Errors as the server answers them: an OpenAI-style body `{"error": {"message", "type",
"param", "code"}}` that says what is wrong and, where a field is to blame, which one."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from venusrl.engine.async_engine import EngineClosed
from venusrl.engine.engine import RequestError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(EngineClosed)
    async def engine_closed(request: Request, exc: EngineClosed) -> JSONResponse:
        return error_response(503, f"the engine is not running: {exc}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s failed", request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log")


def checked(check: Callable[[], None]) -> None:
    """Run one of the engine's request checks; its `RequestError` becomes a 400."""
    try:
        check()
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None


# Fields whose value may take several forms: one message for all of them, not one per form.
FORMS = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One line for a body that does not validate, naming the field as a client writes it
    (`messages[0].content`), and that field."""
    first = errors[0]
    loc = [p for p in first["loc"] if p != "body"]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        at = f" at character {loc[0]}" if loc else ""
        return f"the body is not valid JSON: {reason}{at}", None
    if not loc:
        return (
            f"the body must be a JSON object (Content-Type: application/json): {first['msg']}",
            None,
        )
    # Drop the union members pydantic names in a location ('str', 'list[int]', ...).
    fields = [p for p in loc if isinstance(p, int) or not _is_type_tag(str(p))]
    same_field = [e for e in errors if [p for p in e["loc"] if p != "body"][:1] == loc[:1]]
    named = max((i for i, p in enumerate(fields) if isinstance(p, str)), default=-1)
    name = str(fields[named]) if named >= 0 else ""
    union = name in FORMS and len(same_field) > 1
    if union:  # every form failed: name the field, not a position inside one of its forms
        fields = fields[: named + 1]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in fields).lstrip(".")
    message = f"{where}: must be {FORMS[name]}" if union else f"{where}: {first['msg']}"
    others = len(errors) - (len(same_field) if union else 1)
    if others > 0:
        message += f" (and {others} more problems)"
    return message, where


def _is_type_tag(part: str) -> bool:
    # A union's model member is named by its class (`NamedToolChoice`); fields are lower case.
    return (
        "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "list", "dict")
    )
