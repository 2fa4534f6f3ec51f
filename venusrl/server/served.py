"""The model a server serves, as its routes use it: the engine on its thread, the tokenizer,
and the checks every request passes before anything of it runs or a stream opens."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable, Sequence
from typing import TypeVar

from fastapi import Request

from venusrl.engine.async_engine import AsyncEngine
from venusrl.engine.engine import Engine, RequestError
from venusrl.model.tokenizer import Tokenizer, cut_at_stop
from venusrl.model.tool_formats import ToolParser, resolve_tool_parser
from venusrl.server.bodies import SamplingBody
from venusrl.server.errors import ApiError, checked
from venusrl.server.streaming import Jobs, Stream, usage
from venusrl.server.tool_calling import CallRules
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

T = TypeVar("T")

# How often a request whose answer is not streamed checks that its client is still there.
DISCONNECT_POLL_S = 0.25


class Served:
    def __init__(self, engine: Engine, model_name: str, tool_parser_name: str = "auto") -> None:
        self.engine, self.model_name = engine, model_name
        self.runner = AsyncEngine(engine)
        self.tok: Tokenizer | None = engine.tokenizer
        template = None if self.tok is None else self.tok.chat_template
        self.tool_parser: ToolParser = resolve_tool_parser(tool_parser_name, template)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tok is None:
                raise ApiError(
                    400, "this model has no tokenizer: send the prompt as token ids", param
                )
            prompt = self.tok.encode(prompt)
        checked(lambda: self.engine.check_prompt(prompt, param))
        return prompt

    def sampling(
        self,
        body: SamplingBody,
        prompt_len: int,
        max_tokens: int | None,
        index: int,
        top_logprobs: int,
        default: int = 16,
    ) -> SamplingParams:
        """Choice `index` of the request: checked here, before any of its choices runs or a
        stream opens."""
        limit = self.engine.max_context - prompt_len
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens "
                f"exceeds the context limit of {self.engine.max_context}",
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
        checked(lambda: self.engine.check_params(params))
        return params

    def text_of(self, out: GenerationOutput, stop: tuple[str, ...]) -> str:
        if self.tok is None:
            return ""
        return cut_at_stop(self.tok.decode(out.token_ids), stop)[0]

    async def run(
        self,
        prompt: list[int],
        params: SamplingParams,
        meta: TurnMeta | None = None,
        request_id: str | None = None,
    ) -> GenerationOutput:
        try:
            return await self.runner.generate(prompt, params, meta, request_id)
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None

    async def run_all(self, request: Request, jobs: Jobs) -> list[GenerationOutput]:
        """Every job, or none: when one fails or the client goes away, the others stop."""
        return await unless_disconnected(request, _all(self.run(ids, sp) for ids, sp in jobs))

    @staticmethod
    def usage(outs: Sequence[GenerationOutput], n: int) -> dict[str, int]:
        return usage(sum(len(o.prompt_ids) for o in outs), sum(len(o.token_ids) for o in outs), n)

    def stream(
        self,
        body: SamplingBody,
        jobs: Jobs,
        rid: str,
        created: int,
        logprobs: bool,
        calls: CallRules | None = None,
    ) -> Stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return Stream(
            self.runner, jobs, rid, created, self.model_name, self.tok, body.n, logprobs,
            include_usage, calls,
        )  # fmt: skip


def served(request: Request) -> Served:
    """The route handlers' dependency: the app's served model."""
    model: Served = request.app.state.served
    return model


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


async def _all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather`, except that the first failure cancels the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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
