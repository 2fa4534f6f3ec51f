"""One harness conversation as both sides hold it. The HTTP side (the gateway's thread) hands
each request to the episode (on the rollout's event loop) and waits for the answer; the episode
checks that the conversation only grows, and turns what is new in it into the observation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from venusrl.envs.environment import SandboxVerbs
from venusrl.envs.types import ExecResult
from venusrl.server.bodies import ChatBody, ChatMessage
from venusrl.server.errors import ApiError
from venusrl.server.streaming import usage


@dataclass(frozen=True)
class Answer:
    """The model's turn as the harness gets it: content and calls in OpenAI's shape, the
    tokens of its prompt and its own, and whether the engine cut it at its token limit."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cut: bool = False

    @property
    def finish_reason(self) -> str:
        if self.cut:  # a call in a cut turn may be whole, but the turn is not
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens, n=1)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


Key = tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]  # a conversation, `comparable`
T = TypeVar("T")


@dataclass(frozen=True)
class Pending:
    """A request the episode has not answered yet; `answer` resolves on the episode's loop."""

    body: ChatBody
    key: Key
    answer: asyncio.Future[Answer]

    def settle(self, answer: Answer | BaseException) -> None:
        """Answer it, once: an answer that comes late (the session ended first) is dropped."""
        if self.answer.done():
            return
        if isinstance(answer, BaseException):
            self.answer.set_exception(answer)
        else:
            self.answer.set_result(answer)


class Session:
    """Created by the episode, on its loop; `ask` and `run` are called from any other loop.

    One request is in flight at a time. A client that gave up waiting and sends the same
    request again (OpenAI's and Anthropic's clients retry on a timeout) gets the answer of the
    first: the one in flight, or the last one given. `run` runs a command of the harness's
    tools in the episode's `sandbox`, any number at once."""

    def __init__(self, sandbox: SandboxVerbs | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.sandbox = sandbox
        self.requests: asyncio.Queue[Pending] = asyncio.Queue()
        self.in_flight: Pending | None = None
        self.answered: tuple[Key, Answer] | None = None  # the last request and its answer
        self.ended: str | None = None  # why, once the episode is over

    async def ask(self, body: ChatBody) -> Answer:
        return await self._on_episode_loop(self._submit(body))

    async def run(
        self, command: str | Sequence[str], timeout_s: float, max_output_bytes: int
    ) -> ExecResult:
        return await self._on_episode_loop(self._run(command, timeout_s, max_output_bytes))

    async def _on_episode_loop(self, call: Coroutine[Any, Any, T]) -> T:
        try:
            handed = asyncio.run_coroutine_threadsafe(call, self.loop)
        except RuntimeError:  # the episode's loop has closed
            call.close()
            raise self.gone("the run that held it has stopped") from None
        return await asyncio.wrap_future(handed)

    async def _run(
        self, command: str | Sequence[str], timeout_s: float, max_output_bytes: int
    ) -> ExecResult:
        if self.ended is not None:
            raise self.gone(self.ended)
        if self.sandbox is None:
            raise ApiError(409, "this episode has no sandbox", code="no_sandbox")
        try:
            return await self.sandbox.exec(
                command, timeout_s=timeout_s, max_output_bytes=max_output_bytes
            )
        except Exception as e:  # the sandbox's failure, not the request's
            if self.ended is not None:
                raise self.gone(self.ended) from None
            raise ApiError(503, f"the sandbox could not run it: {type(e).__name__}: {e}") from e

    async def _submit(self, body: ChatBody) -> Answer:
        if self.ended is not None:
            raise self.gone(self.ended)
        key: Key = tuple(comparable(m) for m in body.messages)
        if self.answered is not None and self.answered[0] == key:
            return self.answered[1]
        pending = self.in_flight
        if pending is None:
            pending = Pending(body, key, self.loop.create_future())
            pending.answer.add_done_callback(lambda _: self._done(pending))
            self.in_flight = pending
            self.requests.put_nowait(pending)
        elif pending.key != key:
            raise ApiError(
                409,
                "this session already has a request in flight: an episode is one conversation, "
                "one model turn at a time (n > 1 or parallel requests need sessions of their own)",
            )
        # Shielded: a client that goes away cancels its wait, not the turn.
        return await asyncio.shield(pending.answer)

    def _done(self, pending: Pending) -> None:
        if self.in_flight is pending:
            self.in_flight = None
        if not pending.answer.cancelled() and pending.answer.exception() is None:
            self.answered = pending.key, pending.answer.result()

    def end(self, reason: str) -> None:
        """No request is taken from now on; one in flight gets `reason`."""
        self.ended = reason
        if self.in_flight is not None:
            self.in_flight.settle(self.gone(reason))

    @staticmethod
    def gone(reason: str) -> ApiError:
        return ApiError(410, f"this session's episode has ended: {reason}", code="session_ended")


def comparable(message: ChatMessage) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """What of a message must come back unchanged: its role, text and calls. Ids and fields a
    client adds (`refusal`, `annotations`) may differ; the model's tokens cannot."""
    calls = tuple(
        (c.function.name, json.dumps(c.function.parsed_arguments(), sort_keys=True))
        for c in message.tool_calls or ()
    )
    return message.role, message.text(), calls


def new_messages(held: Sequence[ChatMessage], sent: Sequence[ChatMessage]) -> list[ChatMessage]:
    """What `sent` adds to the conversation `held`, which it must begin with: 409 naming the
    first message that differs otherwise (a harness that summarises or drops turns rewrites what
    the model saw, and a record of one token sequence cannot follow it)."""
    for i, (was, now) in enumerate(zip(held, sent, strict=False)):
        if comparable(was) != comparable(now):
            raise ApiError(
                409,
                f"messages[{i}] is not the {was.role} message this session sent or answered "
                "there: venusrl trains on the conversation the model saw, so a session's "
                "history can only grow (start a new session for a rewritten one)",
                f"messages[{i}]",
                "history_rewritten",
            )
    if len(sent) <= len(held):
        raise ApiError(400, "no new message after the model's last answer", "messages")
    added = list(sent[len(held) :])
    roles = [m.role for m in added]
    tools = len(roles) - (roles[-1] == "user")
    if set(roles[:tools]) - {"tool"} or (tools == 0 and len(roles) > 1):
        raise ApiError(
            400,
            "after the model's answer the gateway takes its tool results (tool messages), then "
            f"at most one user message, got {roles}",
            f"messages[{len(held)}]",
        )
    return added
