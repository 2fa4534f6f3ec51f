"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions` (text or token-id
prompts; choices carry `token_ids` too) and `POST /v1/chat/completions` (the tokenizer's chat
template, with tool calling: `server.tool_calling`), whole or streamed."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from jinja2 import TemplateError

from venusrl.server.bodies import ChatBody, CompletionBody
from venusrl.server.errors import ApiError
from venusrl.server.logprobs import chat_logprobs, completion_logprobs
from venusrl.server.served import Served, served
from venusrl.server.streaming import sse, stream_chat, stream_completion
from venusrl.server.tool_calling import CallRules, template_input

router = APIRouter()
Model = Annotated[Served, Depends(served)]


@router.get("/v1/models")
async def models(model: Model) -> dict[str, Any]:
    card = {
        "id": model.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "venusrl",
        "max_model_len": model.engine.max_context,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionBody, request: Request, model: Model) -> Any:
    model.check_model(body.model)
    body.refuse_unsupported()
    raw = body.prompt
    single = isinstance(raw, str) or (raw and isinstance(raw[0], int))
    prompts: list[Any] = [raw] if single else list(raw)
    if not prompts:
        raise ApiError(400, "prompt is empty", "prompt")
    encoded = [
        model.encode(p, "prompt" if single else f"prompt[{i}]") for i, p in enumerate(prompts)
    ]
    top = body.logprobs or 0
    jobs = [
        (ids, model.sampling(body, len(ids), body.max_tokens, i * body.n + j, top))
        for i, ids in enumerate(encoded)
        for j in range(body.n)
    ]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        with_logprobs = body.logprobs is not None
        return sse(stream_completion(model.stream(body, jobs, rid, created, with_logprobs)))
    outs = await model.run_all(request, jobs)
    choices = []
    for index, ((_, sp), out) in enumerate(zip(jobs, outs, strict=True)):
        logprobs = (
            None
            if body.logprobs is None
            else completion_logprobs(model.tok, sp, out.token_ids, out.logprobs, out.top_logprobs)
        )
        choices.append(
            {
                "index": index,
                "text": model.text_of(out, sp.stop),
                "finish_reason": out.finish_reason,
                "token_ids": out.token_ids,
                "logprobs": logprobs,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model.model_name,
        "choices": choices,
        "usage": model.usage(outs, body.n),
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat(body: ChatBody, request: Request, model: Model) -> Any:
    model.check_model(body.model)
    body.refuse_unsupported()
    body.cross_check()
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tok = model.tok
    if tok is None or tok.chat_template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    messages, tools = template_input(body, tok.renders_tools, model.tool_parser)
    try:
        # Messages' text stays text: a user typing "<|im_start|>system" gets those characters,
        # not a system turn.
        chat = tok.encode_chat(messages, tools=tools)
    except TemplateError as e:
        raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
    ids = model.encode(chat, "messages")
    max_tokens = body.max_completion_tokens or body.max_tokens
    # As OpenAI's chat API: without max_tokens, generate up to the context limit.
    limit = model.engine.max_context
    top = body.top_logprobs or 0
    jobs = [(ids, model.sampling(body, len(ids), max_tokens, j, top, limit)) for j in range(body.n)]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    rules = CallRules.of(body, model.tool_parser)
    if body.stream:
        return sse(stream_chat(model.stream(body, jobs, rid, created, body.logprobs, rules)))
    outs = await model.run_all(request, jobs)
    choices = []
    for index, ((_, sp), out) in enumerate(zip(jobs, outs, strict=True)):
        logprobs = (
            chat_logprobs(tok, out.token_ids, out.logprobs, out.top_logprobs)
            if body.logprobs
            else None
        )
        text = model.text_of(out, sp.stop)
        content, calls = rules.split(text) if rules else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": index,
                "finish_reason": "tool_calls" if calls else out.finish_reason,
                "message": message,
                "logprobs": logprobs,
                "token_ids": out.token_ids,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model.model_name,
        "choices": choices,
        "usage": model.usage(outs, body.n),
    }
