"""HTTP server: OpenAI-compatible completions and chat, plus the native token-level API.

    GET  /health                 200 once the model is loaded
    GET  /v1/models
    GET  /stats                  the engine's counters: cache hits, re-prefills, offloads, busy time
    POST /v1/completions         prompt as text or token ids; choices carry `token_ids` too
    POST /v1/chat/completions    the tokenizer's chat template
    POST /generate               token ids + trajectory metadata -> tokens, logprobs, versions
                                 (and `top_logprobs`: [token id, logprob] pairs, when asked)
    POST /end_trajectory         no request of this trajectory follows: its KV may go
    POST /update_weights         load a safetensors directory into the running engine

Every error is a 4xx/5xx with an OpenAI-style body `{"error": {"message", "type", "param"}}`
that says what is wrong; one bad request never disturbs the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from venusrl.engine.async_engine import AsyncEngine, EngineClosed, TokenDelta
from venusrl.engine.engine import Engine, RequestError
from venusrl.engine.model import ModelConfigError
from venusrl.engine.request import MAX_TOP_LOGPROBS, GenerationOutput, SamplingParams, TopLogprobs
from venusrl.engine.tokenizer import IncrementalDecoder, Tokenizer, cut_at_stop

log = logging.getLogger(__name__)
T = TypeVar("T")

# How often a request whose answer is not streamed checks that its client is still there.
DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# -- request bodies -----------------------------------------------------------------------------

# JSON types as they are: "5" is not a number, true is not 1.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]

# Fields of OpenAI's API that change what is generated, with the value that changes nothing:
# ignoring one silently would answer something else than what was asked.
UNSUPPORTED: dict[str, Any] = {
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "best_of": 1,
    "suffix": "",
    "response_format": {"type": "text"},
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "function_call": "none",
}


class _OpenAIBody(BaseModel):
    # OpenAI clients send fields we do not use (kept, to refuse those that would change the
    # answer), and null for a field they leave unset.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def refuse_unsupported(self) -> None:
        for key, value in (self.model_extra or {}).items():
            if key in UNSUPPORTED and value != UNSUPPORTED[key]:
                raise ApiError(400, f"{key} is not supported by this server", key)


class StreamOptions(_OpenAIBody):
    include_usage: Bool = False


class _Sampling(_OpenAIBody):
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0, le=100)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    seed: Int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    n: Int = Field(1, ge=1, le=64)
    stream: Bool = False
    stream_options: StreamOptions | None = None


class CompletionBody(_Sampling):
    model: str | None = None
    prompt: str | list[Int] | list[str] | list[list[Int]]
    # k: the sampled tokens' logprobs and, when k > 0, each position's k most likely tokens
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False


class ContentPart(_OpenAIBody):
    type: Literal["text"]
    text: str


class ChatMessage(_OpenAIBody):
    role: str
    content: str | list[ContentPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content
        if not isinstance(text, str):
            text = "".join(part.text for part in text)
        return {"role": self.role, "content": text}


class ChatBody(_Sampling):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class _NativeBody(BaseModel):
    # The native API has no clients to tolerate: a misspelt key is an error, not a default.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerateSampling(_NativeBody):
    max_tokens: Int = Field(16, ge=1)
    temperature: Float = Field(1.0, ge=0, le=100)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    seed: Int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[Int] = Field(default_factory=list)
    ignore_eos: Bool = False
    top_logprobs: Int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            **{
                **self.model_dump(),
                "stop": tuple(stop),
                "stop_token_ids": tuple(self.stop_token_ids),
            }
        )


class GenerateBody(_NativeBody):
    input_ids: list[Int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    request_id: str | None = None
    trajectory_id: str | None = None
    group_id: str | None = None
    priority: Int = 0
    expected_wait_s: Float | None = Field(None, ge=0)  # the tool wait after this turn


class EndTrajectoryBody(_NativeBody):
    trajectory_id: str


class UpdateWeightsBody(_NativeBody):
    path: str = Field(min_length=1)
    version: Int | None = Field(None, ge=0)
    flush_cache: Bool = False


# -- the app ------------------------------------------------------------------------------------


def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    runner = AsyncEngine(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="venusrl engine", lifespan=lifespan)
    app.state.runner = runner
    tok = engine.tokenizer

    if api_key:
        app.add_middleware(_ApiKeyCheck, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return _error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(EngineClosed)
    async def engine_closed(request: Request, exc: EngineClosed) -> JSONResponse:
        return _error(503, f"the engine is not running: {exc}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s failed", request.url.path)
        return _error(500, f"internal error ({type(exc).__name__}); see the server log")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )

    def encode(prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if tok is None:
                raise ApiError(
                    400, "this model has no tokenizer: send the prompt as token ids", param
                )
            prompt = tok.encode(prompt)
        checked(lambda: engine.check_prompt(prompt, param))
        return prompt

    def sampling(
        body: _Sampling,
        prompt_len: int,
        max_tokens: int | None,
        index: int,
        top_logprobs: int,
        default: int = 16,
    ) -> SamplingParams:
        """Choice `index` of the request: checked here, before any of its choices runs or a
        stream opens."""
        limit = engine.max_context - prompt_len
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens "
                f"exceeds the context limit of {engine.max_context}",
                "max_tokens",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else min(default, limit),
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=None if body.seed is None else choice_seed(body.seed, index),
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                top_logprobs=top_logprobs,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        checked(lambda: engine.check_params(params))
        return params

    def text_of(out: GenerationOutput, stop: tuple[str, ...]) -> str:
        return cut_at_stop(tok.decode(out.token_ids), stop)[0] if tok is not None else ""

    async def run(prompt: list[int], params: SamplingParams, **meta: Any) -> GenerationOutput:
        try:
            return await runner.generate(prompt, params, **meta)
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None

    async def run_all(request: Request, jobs: Jobs) -> list[GenerationOutput]:
        """Every job, or none: when one fails or the client goes away, the others stop."""
        return await _unless_disconnected(request, _all(run(ids, sp) for ids, sp in jobs))

    def usage(outs: Sequence[GenerationOutput], n: int) -> dict[str, int]:
        return _usage(sum(len(o.prompt_ids) for o in outs), sum(len(o.token_ids) for o in outs), n)

    def stream(body: _Sampling, jobs: Jobs, rid: str, created: int, logprobs: bool) -> _Stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _Stream(runner, jobs, rid, created, model_name, tok, body.n, logprobs, include_usage)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Also the engine's load, read between its steps' bookkeeping (plain counts)."""
        return {
            "status": "ok",
            "weight_version": engine.weight_version,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "free_device_kv_pages": engine.kv.device_pages.num_free,
            "free_host_kv_pages": engine.kv.host_pages.num_free,
        }

    @app.get("/stats")
    async def stats() -> dict[str, int | float]:
        return await runner.call(lambda e: e.counters())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "venusrl",
            "max_model_len": engine.max_context,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Any:
        check_model(body.model)
        body.refuse_unsupported()
        raw = body.prompt
        single = isinstance(raw, str) or (raw and isinstance(raw[0], int))
        prompts: list[Any] = [raw] if single else list(raw)
        if not prompts:
            raise ApiError(400, "prompt is empty", "prompt")
        encoded = [encode(p, "prompt" if single else f"prompt[{i}]") for i, p in enumerate(prompts)]
        jobs = [
            (ids, sampling(body, len(ids), body.max_tokens, i * body.n + j, body.logprobs or 0))
            for i, ids in enumerate(encoded)
            for j in range(body.n)
        ]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            s = stream(body, jobs, rid, created, body.logprobs is not None)
            return _sse(_stream_completion(s))
        outs = await run_all(request, jobs)
        choices = []
        for index, ((_, sp), out) in enumerate(zip(jobs, outs, strict=True)):
            choice: dict[str, Any] = {
                "index": index,
                "text": text_of(out, sp.stop),
                "finish_reason": out.finish_reason,
                "token_ids": out.token_ids,
            }
            choice["logprobs"] = (
                None
                if body.logprobs is None
                else _completion_logprobs(tok, sp, out.token_ids, out.logprobs, out.top_logprobs)
            )
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(outs, body.n),
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatBody, request: Request) -> Any:
        check_model(body.model)
        body.refuse_unsupported()
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if tok is None or tok.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            # Messages' text stays text: a user typing "<|im_start|>system" gets those
            # characters, not a system turn.
            chat = tok.encode_chat([m.as_template_input() for m in body.messages])
        except TemplateError as e:
            raise ApiError(
                400, f"the chat template rejected the messages: {e}", "messages"
            ) from None
        ids = encode(chat, "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        # As OpenAI's chat API: without max_tokens, generate up to the context limit.
        limit = engine.max_context
        top = body.top_logprobs or 0
        jobs = [(ids, sampling(body, len(ids), max_tokens, j, top, limit)) for j in range(body.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return _sse(_stream_chat(stream(body, jobs, rid, created, body.logprobs)))
        outs = await run_all(request, jobs)
        choices = []
        for index, ((_, sp), out) in enumerate(zip(jobs, outs, strict=True)):
            choices.append(
                {
                    "index": index,
                    "finish_reason": out.finish_reason,
                    "message": {"role": "assistant", "content": text_of(out, sp.stop)},
                    "logprobs": (
                        _chat_logprobs(tok, out.token_ids, out.logprobs, out.top_logprobs)
                        if body.logprobs
                        else None
                    ),
                    "token_ids": out.token_ids,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(outs, body.n),
        }

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
        try:
            params = body.sampling_params.params()
        except ValueError as e:
            raise ApiError(400, f"sampling_params: {e}", "sampling_params") from None
        out = await _unless_disconnected(
            request,
            run(
                body.input_ids,
                params,
                request_id=body.request_id,
                trajectory_id=body.trajectory_id,
                group_id=body.group_id,
                priority=body.priority,
                expected_wait_s=body.expected_wait_s,
            ),
        )
        return {
            "request_id": out.request_id,
            "token_ids": out.token_ids,
            "logprobs": out.logprobs,
            "weight_versions": out.weight_versions,
            "top_logprobs": out.top_logprobs,
            "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_ids),
            "cached_tokens": out.cached_prompt_tokens,
        }

    @app.post("/end_trajectory")
    async def end_trajectory(body: EndTrajectoryBody) -> dict[str, Any]:
        await runner.call(lambda e: e.end_trajectory(body.trajectory_id))
        return {"trajectory_id": body.trajectory_id}

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsBody) -> dict[str, Any]:
        path = Path(body.path)
        if not path.is_absolute():
            raise ApiError(
                400,
                f"path {body.path!r} is relative: give an absolute path (the server's working "
                "directory is not the client's)",
                "path",
            )
        if not path.is_dir():
            raise ApiError(400, f"path {body.path!r} is not a directory", "path")
        try:
            version = await runner.call(
                lambda e: e.update_weights(path, body.version, body.flush_cache)
            )
        except ModelConfigError as e:
            raise ApiError(400, str(e), "path") from None
        except Exception as e:  # unreadable or corrupt files: nothing was loaded
            raise ApiError(400, f"cannot load weights from {body.path!r}: {e}", "path") from None
        return {"weight_version": version}

    return app


Jobs = list[tuple[list[int], SamplingParams]]

# Fields whose value may take several forms: one message for all of them, not one per form.
FORMS = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


class _ApiKeyCheck:
    """Refuses every path but /health without the key. Plain ASGI: a `@app.middleware("http")`
    (Starlette's BaseHTTPMiddleware) hides the client's disconnect from the endpoint, so a
    request whose client went away would run to its end."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(given.encode(), self.expected):
                response = _error(401, "missing or wrong API key (Authorization: Bearer ...)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def checked(check: Callable[[], None]) -> None:
    """Run one of the engine's request checks; its `RequestError` becomes a 400."""
    try:
        check()
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (n > 1, or several prompts). Choice 0
    keeps the seed (n = 1 and n > 1 agree on it); the others are mixed (splitmix64), so that
    seed s's second choice is not seed s + 1's first."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return (z ^ (z >> 31)) % 2**63


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
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
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict")


async def _all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather`, except that the first failure cancels the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (its requests aborted) if the client disconnects first: the
    server cancels only a streamed answer when its client goes."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "the client disconnected")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await task


def _usage(prompt_tokens: int, completion_tokens: int, n: int) -> dict[str, int]:
    prompt = prompt_tokens // n  # each prompt counts once, as OpenAI counts it
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def _token_text(tok: Tokenizer | None, token: int) -> str:
    return tok.decode([token]) if tok is not None else str(token)


def _completion_logprobs(
    tok: Tokenizer | None,
    sp: SamplingParams,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
) -> dict[str, Any]:
    """OpenAI's legacy shape: with `logprobs: k > 0`, each position's k most likely tokens by
    text, and the sampled one too (up to k + 1 entries, as OpenAI documents). Tokens that decode
    to the same text keep the most likely's logprob."""
    top_logprobs = None
    if sp.top_logprobs > 0:
        top_logprobs = []
        for token, logprob, top in zip(tokens, logprobs, tops, strict=True):
            by_text: dict[str, float] = {}
            for t, lp in [*top, (token, logprob)]:
                by_text.setdefault(_token_text(tok, t), lp)
            top_logprobs.append(by_text)
    return {
        "tokens": [_token_text(tok, t) for t in tokens],
        "token_logprobs": list(logprobs),
        "top_logprobs": top_logprobs,
        "text_offset": None,
    }


def _chat_logprobs(
    tok: Tokenizer | None,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
) -> dict[str, Any]:
    """`tops` is empty when no alternatives were asked: each token's `top_logprobs` is then []."""
    content = []
    for t, lp, top in zip(tokens, logprobs, tops or [[] for _ in tokens], strict=True):
        alternatives = [_chat_token(tok, a, alp) for a, alp in top]
        content.append({**_chat_token(tok, t, lp), "top_logprobs": alternatives})
    return {"content": content}


def _chat_token(tok: Tokenizer | None, token: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestError as e:
            error = {
                "error": {"message": str(e), "type": "invalid_request_error", "param": e.param}
            }
            yield f"data: {json.dumps(error)}\n\n"
        except Exception as e:  # the stream has started: report in-band, then end it cleanly
            log.exception("streamed request failed")
            error = {
                "error": {"message": f"internal error ({type(e).__name__})", "type": "server_error"}
            }
            yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _deltas(runner: AsyncEngine, jobs: Jobs) -> AsyncIterator[tuple[int, TokenDelta]]:
    """Deltas of several requests, interleaved as they come."""
    queue: asyncio.Queue[tuple[int, TokenDelta] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, ids: list[int], sp: SamplingParams) -> None:
        try:
            async for delta in runner.stream(ids, sp):
                await queue.put((index, delta))
        except BaseException as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, ids, sp)) for i, (ids, sp) in enumerate(jobs)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


@dataclass(frozen=True)
class _Stream:
    runner: AsyncEngine
    jobs: Jobs
    rid: str
    created: int
    model: str
    tok: Tokenizer | None
    n: int
    logprobs: bool
    include_usage: bool  # a last chunk with no choices and the request's usage


async def _pieces(s: _Stream) -> AsyncIterator[tuple[int, TokenDelta, str]]:
    """Each choice's deltas with the text they add (held back while it may begin a stop
    string)."""
    decoders = [IncrementalDecoder(s.tok, sp.stop) if s.tok else None for _, sp in s.jobs]
    async for index, delta in _deltas(s.runner, s.jobs):
        decoder = decoders[index]
        piece = decoder.push(delta.token_ids, delta.output is not None) if decoder else ""
        yield index, delta, piece


def _finish_reason(delta: TokenDelta) -> str | None:
    return delta.output.finish_reason if delta.output is not None else None


def _stream_usage(s: _Stream, completion_tokens: int) -> dict[str, int]:
    return _usage(sum(len(ids) for ids, _ in s.jobs), completion_tokens, s.n)


async def _stream_completion(s: _Stream) -> AsyncIterator[dict[str, Any]]:
    base = {"id": s.rid, "object": "text_completion", "created": s.created, "model": s.model}
    completion_tokens = 0
    async for index, delta, piece in _pieces(s):
        completion_tokens += len(delta.token_ids)
        choice: dict[str, Any] = {
            "index": index,
            "text": piece,
            "token_ids": delta.token_ids,
            "finish_reason": _finish_reason(delta),
        }
        if s.logprobs:
            sp = s.jobs[index][1]
            choice["logprobs"] = _completion_logprobs(
                s.tok, sp, delta.token_ids, delta.logprobs, delta.top_logprobs
            )
        yield {**base, "choices": [choice]}
    if s.include_usage:
        yield {**base, "choices": [], "usage": _stream_usage(s, completion_tokens)}


async def _stream_chat(s: _Stream) -> AsyncIterator[dict[str, Any]]:
    base = {"id": s.rid, "object": "chat.completion.chunk", "created": s.created, "model": s.model}
    for index in range(len(s.jobs)):
        role = {"role": "assistant", "content": ""}
        yield {**base, "choices": [{"index": index, "delta": role, "finish_reason": None}]}
    completion_tokens = 0
    async for index, delta, piece in _pieces(s):
        completion_tokens += len(delta.token_ids)
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": piece},
            "finish_reason": _finish_reason(delta),
        }
        if s.logprobs:
            choice["logprobs"] = _chat_logprobs(
                s.tok, delta.token_ids, delta.logprobs, delta.top_logprobs
            )
        yield {**base, "choices": [choice]}
    if s.include_usage:
        yield {**base, "choices": [], "usage": _stream_usage(s, completion_tokens)}
