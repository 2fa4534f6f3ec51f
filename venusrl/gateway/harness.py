"""Training on an unmodified agent harness: its own loop, prompts and tools, pointed at the
gateway (`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL`), one episode per run of its command. Each of
its requests is one model turn; only what a request adds to the conversation is rendered, after
the model's turn, as the agent loop renders our own environments' observations, so the record is
what the model saw and sampled (docs/environments.md, "An agent harness of your own")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from venusrl.envs.environment import (
    Environment,
    Message,
    ModelTurn,
    SandboxVerbs,
    StepResult,
    Task,
    Tool,
)
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
    messages: list[dict[str, Any]]


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
        `OPENAI_API_KEY`/`ANTHROPIC_API_KEY`, the task's prompt in `VENUSRL_TASK_PROMPT`, and
        `VENUSRL_SANDBOX_URL`: POST `{"command": ..., "timeout_s": ...}` to its `/exec` to run a
        tool's command in the episode's sandbox rather than beside the harness."""

    @abstractmethod
    async def score(self, run: HarnessRun) -> float:
        """The episode's reward from what the harness did (and the sandbox's state)."""

    def __init__(self, task: Task, sandbox: SandboxVerbs) -> None:
        super().__init__(task, sandbox)
        self.session: Session | None = None
        self.session_id = ""  # the gateway's name for it, once open
        self.process: asyncio.subprocess.Process | None = None
        # Its output goes to files, not pipes: a child it leaves running would hold a pipe open,
        # and asyncio sees a process exit only once its pipes close.
        self.outputs = (tempfile.TemporaryFile(), tempfile.TemporaryFile())  # noqa: SIM115 (`close`)
        self.pending: Pending | None = None
        self.held: list[ChatMessage] = []  # the conversation so far, as the harness sent it
        self.opening_tools: list[dict[str, Any]] = []
        self.stopped = False
        self.turn = ModelTurn(0, 0, False)  # the model turn `step` answers next

    async def reset(self) -> list[Message]:
        self.session = Session(self.sandbox)
        self.session_id = Gateway.shared().open(self.session)
        url = Gateway.shared().url(self.session_id)
        env = {
            **os.environ,
            "OPENAI_BASE_URL": f"{url}/v1",
            "OPENAI_API_KEY": "venusrl",
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "venusrl",
            "VENUSRL_TASK_ID": self.task.id,
            "VENUSRL_TASK_PROMPT": self.task.prompt,
            "VENUSRL_SANDBOX_URL": f"{url}/sandbox",
        }
        self.process = await asyncio.create_subprocess_exec(
            *self.command(),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self.outputs[0],
            stderr=self.outputs[1],
            start_new_session=True,  # its own process group: stopped whole with its children
        )
        async with asyncio.timeout(self.start_timeout_s):
            self.pending = await self._next()
        if self.pending is None:
            err = self._output(1).strip()[-2000:]
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

    def model_turn(self, turn: ModelTurn) -> None:
        self.turn = turn

    async def step(self, action_text: str) -> StepResult:
        if self.pending is None:
            raise RuntimeError(f"{self.name}: step() after the episode ended")
        self.turns += 1
        rules = CallRules.of(self.pending.body, self.tool_parser)
        content, calls = rules.split(action_text) if rules else (action_text, [])
        turn = self.turn
        answer = Answer(content, calls, turn.prompt_tokens, turn.completion_tokens, turn.cut)
        self.pending.settle(answer)
        self.held.append(ChatMessage.model_validate(answer.message()))
        if self.turns >= self.max_turns:
            return StepResult(None, True, len(calls), truncated=True)
        self.pending = await self._next()
        if self.pending is None:  # the harness is done
            return StepResult(None, True, len(calls))
        try:
            added = new_messages(self.held, self.pending.body.messages)
        except ApiError as e:
            self.pending.settle(e)
            self.pending = None
            raise
        self.held = list(self.pending.body.messages)
        then = added.pop().text() if added[-1].role == "user" else None
        if not added:
            return StepResult(then, False, len(calls))
        texts = tuple(m.text() for m in added)
        blocks = "\n".join(format_tool_response(t, len(t)) for t in texts)  # not ours to cut
        return StepResult(blocks, False, len(calls), tool_responses=texts, then=then)

    async def reward(self) -> float:
        await self._stop("the episode is over")
        assert self.process is not None  # a reward follows a reset
        messages = [hf_message(m) for m in self.held]
        run = HarnessRun(self.process.returncode, self._output(0), self._output(1), messages)
        return await self.score(run)

    async def close(self) -> None:
        try:
            await self._stop("the episode is over")
        finally:
            Gateway.shared().close(self.session_id)
            for file in self.outputs:
                file.close()

    async def _next(self) -> Pending | None:
        """The harness's next request, or None once it has exited (its group then killed: a
        child it left running must not outlive the episode)."""
        assert self.session is not None and self.process is not None
        asked = asyncio.ensure_future(self.session.requests.get())
        exited = asyncio.ensure_future(self.process.wait())
        try:
            await asyncio.wait({asked, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            if not asked.done():
                asked.cancel()
        # Taken from the queue but not returned (a timeout landed meanwhile): still the
        # session's request in flight, answered when the session ends.
        if asked.done() and not asked.cancelled():
            return asked.result()
        self._kill_group()
        return None

    async def _stop(self, reason: str) -> None:
        """End the session (a request in flight is told why), give the harness `exit_grace_s`
        to exit, then kill its process group. Once."""
        if self.stopped:
            return
        self.stopped = True
        if self.session is not None:
            self.session.end(reason)
        self.pending = None
        if self.process is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), self.exit_grace_s)
        self._kill_group()
        await self.process.wait()

    def _kill_group(self) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def _output(self, which: int) -> str:
        """The start of the harness's stdout (0) or stderr (1)."""
        file = self.outputs[which]
        file.seek(0)
        return file.read(OUTPUT_LIMIT_BYTES).decode(errors="replace")
