"""The gateway's HTTP side: one server per process, on its own thread and event loop, started on
first use. A session is a URL prefix, `/s/{session}`: OpenAI's clients append `/v1/chat/completions`
to `{prefix}/v1`, Anthropic's `/v1/messages` to the prefix; the harness's tools run commands in the
episode's sandbox at `{prefix}/sandbox/exec`."""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from venusrl.engine.native_wire import Float, Int
from venusrl.gateway.anthropic import MessagesBody, message_events, messages_reply
from venusrl.gateway.session import Answer, Session
from venusrl.server.bodies import ChatBody
from venusrl.server.errors import ApiError, error_response, install_error_handlers
from venusrl.server.streaming import sse
from venusrl.server.tool_calling import call_deltas

router = APIRouter(prefix="/s/{session_id}")
# A request repeats the conversation so far: 128K tokens of context are ~0.5 MB of text.
MAX_BODY_BYTES = 32 << 20
MAX_EXEC_S = 3600.0  # one command of the harness's tools; the step limit bounds them all
MAX_EXEC_OUTPUT_BYTES = 8 << 20  # of each of stdout and stderr


def session(request: Request, session_id: str) -> Session:
    found = request.app.state.sessions.get(session_id)
    if found is None:
        raise ApiError(404, f"no session {session_id!r} (it has ended, or never began)")
    return found


Held = Annotated[Session, Depends(session)]


@router.get("/v1/models")
async def models() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": "venusrl", "object": "model", "owned_by": "venusrl"}]}


@router.post("/v1/chat/completions", response_model=None)
async def chat(body: ChatBody, held: Held) -> Any:
    body.refuse_unsupported()
    body.cross_check()
    if body.n != 1:
        raise ApiError(400, "an episode samples one answer per turn: n must be 1", "n")
    if body.logprobs:
        raise ApiError(400, "the gateway returns no logprobs (the run records them)", "logprobs")
    answer = await held.ask(body)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model or "venusrl"
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse(_chunks(answer, rid, created, model, usage))
    choice = {"index": 0, "finish_reason": answer.finish_reason, "message": answer.message()}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": answer.usage()}  # fmt: skip


async def _chunks(
    answer: Answer, rid: str, created: int, model: str, usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The whole turn as a stream: the episode answers a turn at once, so there is nothing to
    send piece by piece; its usage last, when asked for (`stream_options.include_usage`)."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    delta: dict[str, Any] = {"role": "assistant", "content": answer.content or ""}
    if answer.tool_calls:
        delta["tool_calls"] = call_deltas(answer.tool_calls)
    yield {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    yield {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": answer.finish_reason}]}
    if usage:
        yield {**head, "choices": [], "usage": answer.usage()}


class ExecBody(BaseModel):
    """A command of the harness's tools, for the episode's sandbox: a shell line (`sh -c`) or
    an argv list."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    command: str | list[str] = Field(min_length=1)
    timeout_s: Float = Field(60.0, gt=0, le=MAX_EXEC_S)
    max_output_bytes: Int = Field(1 << 20, ge=1, le=MAX_EXEC_OUTPUT_BYTES)


@router.post("/sandbox/exec")
async def sandbox_exec(body: ExecBody, held: Held) -> dict[str, Any]:
    """Run it in the episode's sandbox (the tools' own isolation: its filesystem, no network,
    its memory limit), not where the harness runs."""
    r = await held.run(body.command, body.timeout_s, body.max_output_bytes)
    return {
        "exit_code": r.exit_code,
        "stdout": r.stdout.decode(errors="replace"),
        "stderr": r.stderr.decode(errors="replace"),
        "timed_out": r.timed_out,
        "truncated": r.truncated,
        "oom_killed": r.oom_killed,
        "duration_s": r.duration_s,
    }


@router.post("/v1/messages", response_model=None)
async def messages(body: MessagesBody, held: Held) -> Any:
    chat = ChatBody.model_validate(body.as_chat())
    chat.cross_check()
    reply = messages_reply(await held.ask(chat), body.model)
    if body.stream:
        return StreamingResponse(message_events(reply), media_type="text/event-stream")
    return reply


class BodyLimit:
    """Refuses a request body over `MAX_BODY_BYTES` before it is read whole: any local process
    can reach the gateway, and what it sends lands in the run's memory."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length")
            if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
                message = f"the body may be at most {MAX_BODY_BYTES} bytes, got {length}"
                await error_response(413, message)(scope, receive, send)
                return
            receive = _counted(receive)
        await self.app(scope, receive, send)


def _counted(receive: Receive) -> Receive:
    """`receive`, failing once a body sent without its length passes the limit."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > MAX_BODY_BYTES:
            raise ApiError(413, f"the body may be at most {MAX_BODY_BYTES} bytes")
        return message

    return counted


class Gateway:
    """The process's gateway: `open` a session, hand its URL to a harness, `close` it."""

    _shared: ClassVar[Gateway | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls) -> Gateway:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        app = FastAPI(title="venusrl gateway")
        app.state.sessions = self.sessions
        install_error_handlers(app)
        app.include_router(router)
        app.add_middleware(BodyLimit)
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve([self.socket])),
            name="venusrl-gateway",
            daemon=True,  # it serves as long as the process runs episodes
        )
        self.thread.start()

    def open(self, session: Session) -> str:
        """A new session's id; unguessable, so one harness cannot write in another's."""
        session_id = secrets.token_urlsafe(16)
        self.sessions[session_id] = session
        return session_id

    def url(self, session_id: str) -> str:
        """The session's URL prefix, for its harness."""
        return f"{self.base}/s/{session_id}"

    def close(self, session_id: str) -> None:
        """The session's URLs answer 404 from now on."""
        self.sessions.pop(session_id, None)
