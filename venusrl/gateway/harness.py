"""Training on an unmodified agent harness: its own loop, prompts and tools, pointed at the
gateway (`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL`), while the episode records every token.

The harness is a command started per episode. Each request it sends is one model turn: the
first request's messages and tools are the episode's opening, rendered once; each later
request must repeat the conversation so far and add the tool results (or one user message),
which join the record as an observation rendered after the model's turn, exactly as the agent
loop renders our own environments' (`agent_loop.ChatFormat`). Earlier turns are never rendered
again, so a chat template that rewrites them (Qwen3 drops earlier `<think>` blocks) changes
nothing: the model is prompted with, and trained on, the tokens it sampled. The run's sampling
applies (a harness's temperature would make the record off-policy); the episode's limits are
the run's (`rollout.*`), and its turn cap `max_turns`. When the harness exits the episode ends
and `score` reads what it did."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from venusrl.envs.environment import Environment, Message, StepResult, Tool
from venusrl.gateway.server import Gateway
from venusrl.gateway.session import Answer, Pending, Session, new_messages
from venusrl.model.tool_calls import format_tool_response
from venusrl.server.bodies import ChatMessage
from venusrl.server.errors import ApiError
from venusrl.server.tool_calling import CallRules, hf_message

OUTPUT_LIMIT_BYTES = 1 << 20  # of each of the harness's stdout and stderr kept for `score`


@dataclass(frozen=True)
class HarnessRun:
    """What the harness did: its exit status (negative: the signal that stopped it, when it
    outlived its episode by `exit_grace_s`), its output, and the conversation as it stood at the
    end (the last answer included)."""

    returncode: int | None
    stdout: str
    stderr: str
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_answer(self) -> str | None:
        """The text of the model's last answer."""
        said = [m for m in self.messages if m["role"] == "assistant"]
        return said[-1]["content"] if said else None


class HarnessEnvironment(Environment):
    """A task family played by an agent harness. Give `name`, `template` (the sandbox the
    reward may use), `tasks`, `command` and `score`."""

    instructions: ClassVar[str] = ""  # the harness's own
    tools: ClassVar[tuple[Tool, ...]] = ()  # the harness's own, announced in its requests
    max_turns: ClassVar[int] = 32
    start_timeout_s: ClassVar[float] = 60.0  # for the harness's first request
    exit_grace_s: ClassVar[float] = 5.0  # for the harness to exit after the episode ended

    @abstractmethod
    def command(self) -> Sequence[str]:
        """The harness's command line for `self.task`. It runs with the gateway in
        `OPENAI_BASE_URL`/`ANTHROPIC_BASE_URL` (the session in the URL) and
        `OPENAI_API_KEY`/`ANTHROPIC_API_KEY`, and the task's prompt in `VENUSRL_TASK_PROMPT`."""

    @abstractmethod
    async def score(self, run: HarnessRun) -> float:
        """The episode's reward from what the harness did (and the sandbox's state)."""

    async def reset(self) -> list[Message]:
        self.session = Session()
        self.url = Gateway.shared().open(self.session)
        env = {
            **os.environ,
            "OPENAI_BASE_URL": f"{self.url}/v1",
            "OPENAI_API_KEY": "venusrl",
            "ANTHROPIC_BASE_URL": self.url,
            "ANTHROPIC_API_KEY": "venusrl",
            "VENUSRL_TASK_ID": self.task.id,
            "VENUSRL_TASK_PROMPT": self.task.prompt,
        }
        self.process = await asyncio.create_subprocess_exec(
            *self.command(),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: stopped whole with its children
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self.outputs = [
            asyncio.ensure_future(_read(s)) for s in (self.process.stdout, self.process.stderr)
        ]
        self.held: list[ChatMessage] = []
        async with asyncio.timeout(self.start_timeout_s):
            self.pending = await self._next()
        if self.pending is None:
            err = (await self.outputs[1]).strip()[-2000:]
            raise RuntimeError(
                f"the harness {list(self.command())} exited with status "
                f"{self.process.returncode} before its first request; stderr: {err or '(empty)'}"
            )
        body = self.pending.body
        self.held = list(body.messages)
        self.opening_tools = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]
        return [hf_message(m) for m in body.messages]

    def tool_schemas(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The tools the harness's first request announced (the opening is rendered once)."""
        return self.opening_tools

    async def step(self, action_text: str) -> StepResult:
        if self.pending is None:
            raise RuntimeError(f"{self.name}: step() after the episode ended")
        self.turns += 1
        rules = CallRules.of(self.pending.body, self.tool_parser)
        content, calls = rules.split(action_text) if rules else (action_text, [])
        answer = Answer(content, calls)
        self.pending.answer.set_result(answer)
        self.held.append(ChatMessage.model_validate(answer.message()))
        if self.turns >= self.max_turns:
            return StepResult(None, True, len(calls), truncated=True)
        self.pending = await self._next()
        if self.pending is None:  # the harness is done
            return StepResult(None, True, len(calls))
        try:
            added = new_messages(self.held, self.pending.body.messages)
        except ApiError as e:
            self.pending.answer.set_exception(e)
            self.pending = None
            raise
        self.held = list(self.pending.body.messages)
        texts = tuple(m.text() for m in added)
        if added[0].role == "user":
            return StepResult(texts[0], False, len(calls))
        blocks = "\n".join(format_tool_response(t, len(t)) for t in texts)  # not ours to cut
        return StepResult(blocks, False, len(calls), tool_responses=texts)

    async def reward(self) -> float:
        await self._stop("the episode is over")
        stdout, stderr = [(await o) for o in self.outputs]
        messages = [hf_message(m) for m in self.held]
        return await self.score(HarnessRun(self.process.returncode, stdout, stderr, messages))

    async def close(self) -> None:
        if hasattr(self, "session"):
            await self._stop("the episode is over")
            Gateway.shared().close(self.url)

    async def _next(self) -> Pending | None:
        """The harness's next request, or None once it has exited."""
        asked = asyncio.ensure_future(self.session.requests.get())
        exited = asyncio.ensure_future(self.process.wait())
        try:
            await asyncio.wait({asked, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            if not asked.done():
                asked.cancel()
        return asked.result() if asked.done() and not asked.cancelled() else None

    async def _stop(self, reason: str) -> None:
        """End the session (a request still waiting is told why), give the harness
        `exit_grace_s` to exit, then kill its process group."""
        self.session.end(reason)
        if self.pending is not None and not self.pending.answer.done():
            self.pending.answer.set_exception(Session.gone(reason))
        self.pending = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), self.exit_grace_s)
        # Its children too, which could otherwise hold its output open (and the episode).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()


async def _read(stream: asyncio.StreamReader) -> str:
    """All of a stream, its first `OUTPUT_LIMIT_BYTES` kept."""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        kept += chunk[: OUTPUT_LIMIT_BYTES - len(kept)]
    return kept.decode(errors="replace")
