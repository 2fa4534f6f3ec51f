"""Streamed answers (server-sent events): the deltas of a request's choices, interleaved as they
come, each with the text it adds (held back while it may begin a stop string)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from venusrl.engine.async_engine import AsyncEngine, TokenDelta
from venusrl.engine.engine import RequestError
from venusrl.model.tokenizer import IncrementalDecoder, Tokenizer
from venusrl.server.logprobs import chat_logprobs, completion_logprobs
from venusrl.server.tool_calling import CallRules, CallWatch, call_deltas
from venusrl.types import SamplingParams

log = logging.getLogger(__name__)

# A request's choices: the prompt's token ids and how to sample each.
Jobs = list[tuple[list[int], SamplingParams]]


def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
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
class Stream:
    runner: AsyncEngine
    jobs: Jobs
    rid: str
    created: int
    model: str
    tok: Tokenizer | None
    n: int
    logprobs: bool
    include_usage: bool  # a last chunk with no choices and the request's usage
    calls: CallRules | None = None  # chat with tools: what of the text may be tool calls


async def _pieces(s: Stream) -> AsyncIterator[tuple[int, TokenDelta, str]]:
    """Each choice's deltas with the text they add (held back while it may begin a stop
    string)."""
    decoders = [IncrementalDecoder(s.tok, sp.stop) if s.tok else None for _, sp in s.jobs]
    async for index, delta in _deltas(s.runner, s.jobs):
        decoder = decoders[index]
        piece = decoder.push(delta.token_ids, delta.output is not None) if decoder else ""
        yield index, delta, piece


def _finish_reason(delta: TokenDelta) -> str | None:
    return delta.output.finish_reason if delta.output is not None else None


def _stream_usage(s: Stream, completion_tokens: int) -> dict[str, int]:
    return usage(sum(len(ids) for ids, _ in s.jobs), completion_tokens, s.n)


async def stream_completion(s: Stream) -> AsyncIterator[dict[str, Any]]:
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
            choice["logprobs"] = completion_logprobs(
                s.tok, sp, delta.token_ids, delta.logprobs, delta.top_logprobs
            )
        yield {**base, "choices": [choice]}
    if s.include_usage:
        yield {**base, "choices": [], "usage": _stream_usage(s, completion_tokens)}


async def stream_chat(s: Stream) -> AsyncIterator[dict[str, Any]]:
    base = {"id": s.rid, "object": "chat.completion.chunk", "created": s.created, "model": s.model}
    for index in range(len(s.jobs)):
        role = {"role": "assistant", "content": ""}
        yield {**base, "choices": [{"index": index, "delta": role, "finish_reason": None}]}
    watches = [CallWatch(s.calls) if s.calls else None for _ in s.jobs]
    completion_tokens = 0
    async for index, delta, piece in _pieces(s):
        completion_tokens += len(delta.token_ids)
        watch, finish_reason = watches[index], _finish_reason(delta)
        calls: list[dict[str, Any]] = []
        if watch is not None:
            piece = watch.push(piece)
            if finish_reason is not None:
                rest, calls = watch.finish()
                piece += rest
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": piece},
            "finish_reason": None if calls else finish_reason,
        }
        if s.logprobs:
            choice["logprobs"] = chat_logprobs(
                s.tok, delta.token_ids, delta.logprobs, delta.top_logprobs
            )
        yield {**base, "choices": [choice]}
        for call_delta in call_deltas(calls):
            choice = {"index": index, "delta": {"tool_calls": [call_delta]}, "finish_reason": None}
            yield {**base, "choices": [choice]}
        if calls:
            choice = {"index": index, "delta": {}, "finish_reason": "tool_calls"}
            yield {**base, "choices": [choice]}
    if s.include_usage:
        yield {**base, "choices": [], "usage": _stream_usage(s, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int, n: int) -> dict[str, int]:
    prompt = prompt_tokens // n  # each prompt counts once, as OpenAI counts it
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }
