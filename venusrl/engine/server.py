"""HTTP server: OpenAI-compatible completions and chat, plus the native token-level API.

    GET  /health                 200 once the model is loaded
    GET  /v1/models
    GET  /stats                  the engine's counters: cache hits, re-prefills, offloads, busy time
    POST /v1/completions         prompt as text or token ids; choices carry `token_ids` too
    POST /v1/chat/completions    the tokenizer's chat template
    POST /generate               token ids + trajectory metadata -> tokens, logprobs, versions
    POST /end_trajectory         no request of this trajectory follows: its KV may go
    POST /update_weights         load a safetensors directory into the running engine

Every error is a 4xx/5xx with an OpenAI-style body `{"error": {"message", "type", "param"}}`
that says what is wrong; one bad request never disturbs the others.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from venusrl.engine.async_engine import AsyncEngine, EngineClosed, TokenDelta
from venusrl.engine.engine import Engine, RequestError
from venusrl.engine.model import ModelConfigError
from venusrl.engine.request import GenerationOutput, SamplingParams
from venusrl.engine.tokenizer import IncrementalDecoder, Tokenizer, cut_at_stop

log = logging.getLogger(__name__)


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use


class _Sampling(_Body):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**62)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=64)
    stream: bool = False


class CompletionBody(_Sampling):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob")
    echo: Literal[False] = False


class ChatMessage(_Body):
    role: str
    content: str


class ChatBody(_Sampling):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)


class GenerateSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            **{
                **self.model_dump(),
                "stop": tuple(stop),
                "stop_token_ids": tuple(self.stop_token_ids),
            }
        )


class GenerateBody(_Body):
    input_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    request_id: str | None = None
    trajectory_id: str | None = None
    group_id: str | None = None
    priority: int = 0
    expected_wait_s: float | None = Field(None, ge=0)  # the tool wait after this turn


class EndTrajectoryBody(_Body):
    trajectory_id: str


class UpdateWeightsBody(_Body):
    path: str
    version: int | None = None
    flush_cache: bool = False


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

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Callable[..., Any]) -> Any:
        given = request.headers.get("authorization", "")
        authorized = hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())
        if api_key and request.url.path != "/health" and not authorized:
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        message = f"{where}: {first['msg']}"
        if len(exc.errors()) > 1:
            message += f" (and {len(exc.errors()) - 1} more problems)"
        return _error(400, message, param=where)

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

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if tok is None:
            raise ApiError(
                400, "this model has no tokenizer: send the prompt as token ids", "prompt"
            )
        return tok.encode(prompt)

    def sampling(
        body: _Sampling, prompt_len: int, max_tokens: int | None, index: int, default: int = 16
    ) -> SamplingParams:
        limit = engine.max_context - prompt_len
        if limit < 1:
            raise ApiError(
                400,
                f"prompt has {prompt_len} tokens; the context limit is {engine.max_context}",
                "prompt",
            )
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens "
                f"exceeds the context limit of {engine.max_context}",
                "max_tokens",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if stop and tok is None:
            raise ApiError(400, "stop strings need a tokenizer; use stop_token_ids", "stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else min(default, limit),
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=None if body.seed is None else body.seed + index,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def text_of(out: GenerationOutput, stop: tuple[str, ...]) -> str:
        return cut_at_stop(tok.decode(out.token_ids), stop)[0] if tok is not None else ""

    async def run(prompt: list[int], params: SamplingParams, **meta: Any) -> GenerationOutput:
        try:
            return await runner.generate(prompt, params, **meta)
        except RequestError as e:
            raise ApiError(400, str(e)) from None

    def usage(outs: list[GenerationOutput], n: int) -> dict[str, int]:
        prompt = sum(len(o.prompt_ids) for o in outs) // n  # each prompt counts once, as OpenAI

        completion = sum(len(o.token_ids) for o in outs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/stats")
    async def stats() -> dict[str, float]:
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
    async def completions(body: CompletionBody) -> Any:
        check_model(body.model)
        raw = body.prompt
        single = isinstance(raw, str) or (raw and isinstance(raw[0], int))
        prompts: list[Any] = [raw] if single else list(raw)
        if not prompts:
            raise ApiError(400, "prompt is empty", "prompt")
        encoded = [encode(p) for p in prompts]
        jobs = [
            (ids, sampling(body, len(ids), body.max_tokens, i * body.n + j))
            for i, ids in enumerate(encoded)
            for j in range(body.n)
        ]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return _sse(_stream_completion(_Stream(runner, jobs, rid, created, model_name, tok)))
        outs = await _gather(run, jobs)
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
                else {
                    "tokens": [tok.decode([t]) if tok else str(t) for t in out.token_ids],
                    "token_logprobs": out.logprobs,
                    "top_logprobs": None,
                    "text_offset": None,
                }
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
    async def chat(body: ChatBody) -> Any:
        check_model(body.model)
        if tok is None or tok.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            text = tok.apply_chat_template([m.model_dump() for m in body.messages])
        except TemplateError as e:
            raise ApiError(
                400, f"the chat template rejected the messages: {e}", "messages"
            ) from None
        ids = tok.encode(text)
        max_tokens = body.max_completion_tokens or body.max_tokens
        # As OpenAI's chat API: without max_tokens, generate up to the context limit.
        limit = engine.max_context
        jobs = [(ids, sampling(body, len(ids), max_tokens, j, limit)) for j in range(body.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return _sse(_stream_chat(_Stream(runner, jobs, rid, created, model_name, tok)))
        outs = await _gather(run, jobs)
        choices = []
        for index, ((_, sp), out) in enumerate(zip(jobs, outs, strict=True)):
            logprobs: dict[str, Any] | None = None
            if body.logprobs:
                logprobs = {
                    "content": [
                        {"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(out.token_ids, out.logprobs, strict=True)
                    ]
                }
            choices.append(
                {
                    "index": index,
                    "finish_reason": out.finish_reason,
                    "message": {"role": "assistant", "content": text_of(out, sp.stop)},
                    "logprobs": logprobs,
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
    async def generate(body: GenerateBody) -> dict[str, Any]:
        try:
            params = body.sampling_params.params()
        except ValueError as e:
            raise ApiError(400, f"sampling_params: {e}", "sampling_params") from None
        out = await run(
            body.input_ids,
            params,
            request_id=body.request_id,
            trajectory_id=body.trajectory_id,
            group_id=body.group_id,
            priority=body.priority,
            expected_wait_s=body.expected_wait_s,
        )
        return {
            "request_id": out.request_id,
            "token_ids": out.token_ids,
            "logprobs": out.logprobs,
            "weight_versions": out.weight_versions,
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
        if not Path(body.path).is_dir():
            raise ApiError(400, f"path {body.path!r} is not a directory", "path")
        try:
            version = await runner.call(
                lambda e: e.update_weights(body.path, body.version, body.flush_cache)
            )
        except ModelConfigError as e:
            raise ApiError(400, str(e), "path") from None
        except Exception as e:  # unreadable or corrupt files: nothing was loaded
            raise ApiError(400, f"cannot load weights from {body.path!r}: {e}", "path") from None
        return {"weight_version": version}

    return app


async def _gather(
    run: Callable[..., Any], jobs: list[tuple[list[int], SamplingParams]]
) -> list[GenerationOutput]:
    return list(await asyncio.gather(*(run(ids, sp) for ids, sp in jobs)))


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestError as e:
            error = {"error": {"message": str(e), "type": "invalid_request_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        except Exception as e:  # the stream has started: report in-band, then end it cleanly
            log.exception("streamed request failed")
            error = {
                "error": {"message": f"internal error ({type(e).__name__})", "type": "server_error"}
            }
            yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _deltas(
    runner: AsyncEngine, jobs: list[tuple[list[int], SamplingParams]]
) -> AsyncIterator[tuple[int, TokenDelta]]:
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
    jobs: list[tuple[list[int], SamplingParams]]
    rid: str
    created: int
    model: str
    tok: Tokenizer | None


async def _stream_completion(s: _Stream) -> AsyncIterator[dict[str, Any]]:
    decoders = [IncrementalDecoder(s.tok, sp.stop) if s.tok else None for _, sp in s.jobs]
    async for index, delta in _deltas(s.runner, s.jobs):
        decoder = decoders[index]
        final = delta.output is not None
        piece = decoder.push(delta.token_ids, final) if decoder else ""
        yield {
            "id": s.rid,
            "object": "text_completion",
            "created": s.created,
            "model": s.model,
            "choices": [
                {
                    "index": index,
                    "text": piece,
                    "token_ids": delta.token_ids,
                    "finish_reason": delta.output.finish_reason if delta.output else None,
                }
            ],
        }


async def _stream_chat(s: _Stream) -> AsyncIterator[dict[str, Any]]:
    base = {"id": s.rid, "object": "chat.completion.chunk", "created": s.created, "model": s.model}
    for index in range(len(s.jobs)):
        yield {
            **base,
            "choices": [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                }
            ],
        }
    async for chunk in _stream_completion(s):
        choice = chunk["choices"][0]
        yield {
            **base,
            "choices": [
                {
                    "index": choice["index"],
                    "delta": {"content": choice["text"]},
                    "finish_reason": choice["finish_reason"],
                }
            ],
        }
