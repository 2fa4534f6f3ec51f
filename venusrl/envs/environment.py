"""The environment API task authors write against: tools, tasks and a gym-like episode.

An environment class is a task family: a warm `template` its sandboxes start from, the `tools` the
model may call, and `tasks(seed)`, an endless stream of tasks whose per-task `setup` and `files` go
to `pool.create_group`. An instance is one episode, one task in one sandbox:

    env = GuessNumber(task, sandbox)
    messages = await env.reset()          # [system (instructions), user (task prompt)]
    # the agent loop renders them with env.tool_schemas() in the model's chat template
    while True:
        result = await env.step(model_turn_text)
        if result.done:
            break
        # the agent loop appends result.tool_responses as tool messages (or, for a template
        # without tools, {"role": "user", "content": result.observation})
    score = await env.reward()

What happens to each kind of trouble, so that one bad turn never kills a rollout:
- a malformed tool call (in the model's format, `tool_parser`), an unknown tool, arguments
  that do not fit the tool's parameters, a tool that raises or times out, a bad path: an
  observation that starts with "error:" and says so; the episode goes on.
- an `InfraFailure` (the sandbox crashed, was preempted, expired): raised out of `step` and
  `reward`. It is the platform's fault, not the model's; the caller retries the trajectory in a
  replacement sandbox rather than training on a turn the platform spoiled.
- a tool still running `TOOL_OVERRUN_GRACE_S` past `tool_timeout_s` (an async `run` that ignores
  its timeout): a warning at once, naming the tool and the trajectory (`acting_for`); the agent
  loop ends the step at `rollout.step_timeout_s`, as an infrastructure failure.
- a turn without any tool call is the model's answer: the episode ends.
- the `max_turns`-th turn runs its tools, then ends the episode with `truncated` True.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from venusrl.envs.tool_schema import function_schema
from venusrl.envs.types import ExecResult, InfraFailure, TemplateSpec
from venusrl.model.tool_calls import (
    ToolCall,
    ToolCallError,
    clip_response,
    format_tool_response,
    json_type,
)
from venusrl.model.tool_formats import ToolParser, tool_parser
from venusrl.types import Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long past `tool_timeout_s` a tool call may run before it is reported as overrunning: a tool
# that bounds its sandbox calls by the timeout returns within a fraction of a second of it.
TOOL_OVERRUN_GRACE_S = 2.0
_trajectory: ContextVar[str | None] = ContextVar("venusrl_trajectory", default=None)


@contextlib.contextmanager
def acting_for(trajectory_id: str) -> Iterator[None]:
    """Environment calls made in this block are for `trajectory_id` (the agent loop wraps each
    step in it): the warning about a tool that overruns its timeout names the trajectory."""
    token = _trajectory.set(trajectory_id)
    try:
        yield
    finally:
        _trajectory.reset(token)


class SandboxVerbs(Protocol):
    """The sandbox verbs that tools and rewards use; `venusrl.envs` sandboxes provide them."""

    async def exec(
        self,
        command: str | Sequence[str],
        /,
        *,
        timeout_s: float,
        max_output_bytes: int,
        stdin: bytes = b"",
    ) -> ExecResult: ...

    async def run_python(self, source: str, /, *, timeout_s: float) -> ExecResult: ...

    async def read_file(self, path: str, /) -> bytes: ...

    async def write_file(self, path: str, data: bytes, /) -> None: ...


class SandboxHandle(SandboxVerbs, Protocol):
    """A sandbox its holder closes."""

    async def close(self) -> None: ...


# Opens a fresh sandbox of a task's template, in its start state, for its caller to close.
OpenSandbox = Callable[[], Awaitable[SandboxHandle]]

# run(sandbox, arguments, timeout_s) -> observation text. It must bound its own waits by timeout_s.
ToolRunner = Callable[[SandboxVerbs, dict[str, Any], float], Awaitable[str]]

_JSON_TYPE_CHECKS: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    With `run` left None the tool is the Python function `name` that the template's setup defines:
    it runs in the sandbox's persistent interpreter as `name(**arguments)` and its return value is
    the observation (a str as it is, anything else as JSON). That keeps tool state (a secret, a
    counter) inside the sandbox, where the model cannot read it and where the reward can. Tools that
    work through processes and files (bash, read_file) give an async `run` instead.

    `parameters` is the JSON schema of the arguments object, shown to the model with the tools
    (`from_function` derives it from a function's signature and docstring). Before a call runs,
    the arguments are checked against its top level (unknown and missing keys, the JSON type of
    each property), so the model gets a plain message instead of a traceback; anything finer is
    the tool's own job.
    """

    name: str
    description: str
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    run: ToolRunner | None = None

    def __post_init__(self) -> None:
        if self.run is None and not self.name.isidentifier():
            raise ValueError(f"a Python tool's name must be a Python identifier, got {self.name!r}")

    @classmethod
    def from_function(cls, function: Callable[..., Any], run: ToolRunner | None = None) -> Tool:
        """The tool `function` describes: its name, its docstring's summary and its parameters'
        schema from the annotations and the docstring's Args section (`tool_schema`). Without
        `run` it is called by that name in the sandbox, so the template's setup must define it
        (its source: `inspect.getsource(function)`)."""
        schema = function_schema(function)
        return cls(schema["name"], schema["description"], schema["parameters"], run)

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def argument_problem(self, arguments: Mapping[str, Any]) -> str | None:
        """What is wrong with `arguments` for this tool, or None when they fit."""
        properties: Mapping[str, Any] = self.parameters.get("properties", {})
        for key, value in arguments.items():
            if key not in properties:
                return f"unknown argument {key!r}; {self.name} takes {sorted(properties)}"
            expected = properties[key].get("type")
            check = _JSON_TYPE_CHECKS.get(expected) if isinstance(expected, str) else None
            if check is not None and not check(value):
                return f"argument {key!r} must be {expected}, got {json_type(value)}"
        missing = [k for k in self.parameters.get("required", ()) if k not in arguments]
        return f"missing required argument {missing[0]!r}" if missing else None


@dataclass(frozen=True)
class Task:
    """One prompt of a task family; every sibling of its group gets the same `setup` and `files`.

    `setup` is Python source run after the template's setup, in the same globals (a secret, the
    task's data); `files` are workspace files laid over the template's. `reference` is ground truth
    for scripted policies and reward code, never rendered into the prompt.
    """

    id: str
    prompt: str
    setup: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)
    reference: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """What the model sees next (nothing once done): `tool_responses`, the answer to each call
    of the turn in order, as tool messages for a chat template that renders them; `observation`,
    the same as one user turn of `<tool_response>` blocks for a template that does not. An
    environment that gives only `observation` has it sent as a user turn either way.

    `then`: a user message after them (an agent harness's reminder after its tool results).
    `tool_calls`: calls in the turn (the run counts them); `tool_errors`: of them, answered with
    an error; `truncated`: the turn cap ended the episode (finish `turn_cap`, not `done`).
    `info`: anything else the environment wants to keep, read by nothing of the run.
    """

    observation: str | None
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    tool_responses: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)
    then: str | None = None


@dataclass(frozen=True)
class ModelTurn:
    """What the engine did for the model turn an environment is about to act on: the tokens
    of its prompt (the episode so far) and of the turn, and whether the engine stopped the turn
    at its token limit rather than at its end."""

    prompt_tokens: int
    completion_tokens: int
    cut: bool


Message = dict[str, str]  # {"role": ..., "content": ...}, what a chat template takes


class Environment(ABC):
    """One episode of a task family: a task, the sandbox it runs in, and the turns so far."""

    name: ClassVar[str]
    template: ClassVar[TemplateSpec]
    instructions: ClassVar[str]  # the system prompt, before the tool section
    tools: ClassVar[tuple[Tool, ...]]
    max_turns: ClassVar[int] = 8
    max_tool_calls_per_turn: ClassVar[int] = 4  # bounds the tool time one turn can spend
    tool_timeout_s: ClassVar[float] = 10.0
    max_observation_chars: ClassVar[int] = 4096  # per tool response
    # The `reference` keys a task read from a file gives (`envs/task_file.py`), beside its id and
    # prompt (its setup and files come from them: `task_from_reference`); None: the tasks are
    # made in code only (`tasks`).
    reference_fields: ClassVar[tuple[str, ...] | None] = None
    # `reference` keys a file's task may give, read when its row has them (a worked solution
    # the demonstrator plays): a file without them still trains.
    optional_fields: ClassVar[tuple[str, ...]] = ()
    # Where a file's row holds the task's id and prompt, when not in `id` and `prompt` (SWE
    # datasets: instance_id, problem_statement); `task_fields` overrides it.
    default_columns: ClassVar[Mapping[str, str]] = {}
    # Whether `reward` reads the episode's sandbox. False: the environment grades an episode
    # from its output alone, in a fresh sandbox of the task's template (`grade`), as SWE-bench
    # does; reward workers then grade it apart from its rollout (its sandbox closed as its
    # turns end, on a node of their own on Ray).
    reward_reads_sandbox: ClassVar[bool] = True

    def __init__(self, task: Task, sandbox: SandboxVerbs) -> None:
        self.task = task
        self.sandbox = sandbox
        self.turns = 0
        self.done = False
        # The format the model writes calls in; the agent loop sets the model's own
        # (`rollout.tool_parser`) before the episode starts.
        self.tool_parser: ToolParser = tool_parser("hermes")

    @classmethod
    @abstractmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        """An endless stream of tasks; the same seed gives the same stream. Ids never repeat in
        it: a resumed run skips the ids it has trained on."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.reward_reads_sandbox and cls.grade.__func__ is Environment.grade.__func__:  # type: ignore[attr-defined]
            raise TypeError(
                f"{cls.__name__}: reward_reads_sandbox = False says its episodes are graded from"
                " their output alone: it needs a `grade` classmethod that does it"
            )

    @abstractmethod
    async def reward(self) -> float:
        """The episode's score, read from the sandbox's state; 0 for a failed episode."""

    @classmethod
    async def grade(cls, task: Task, output: str | None, open_sandbox: OpenSandbox) -> float:
        """The reward of an episode of `task` that produced `output` (`output()`), graded from it
        alone: in fresh sandboxes of the task's template that `open_sandbox` opens, where it needs
        one (it closes them). For an environment whose reward reads nothing of the episode's own
        sandbox (`reward_reads_sandbox` False); its `reward` may grade the same way."""
        raise NotImplementedError(f"{cls.name}: its reward reads its episode's sandbox")

    async def flag_reward(self, variable: str) -> float:
        """1 when the sandbox interpreter's `variable` is True, else 0: the reward of a game
        whose tool functions keep the outcome in the sandbox, out of the model's reach."""
        r = await self.sandbox.run_python(f"print({variable})", timeout_s=self.tool_timeout_s)
        if not r.ok:
            raise RuntimeError(f"{self.name}: reading the sandbox's state failed: {r.text()}")
        return 1.0 if r.stdout.strip() == b"True" else 0.0

    @classmethod
    def reference_problem(cls, reference: Mapping[str, Any]) -> str | None:
        """What is wrong with the `reference` of a task read from a file (an answer that is no
        number), or None: said when the file is read, naming its line, not by every reward."""
        return None

    @classmethod
    def anchor(cls, reference: Mapping[str, Any], directory: Path) -> dict[str, Any]:
        """A file's row with the paths it holds made absolute against the file's `directory`
        (an SWE row's image in a layout beside the file): a task file and what it points to
        move together. Nothing to do by default."""
        return dict(reference)

    @classmethod
    def task_from_reference(cls, task_id: str, prompt: str, reference: Mapping[str, Any]) -> Task:
        """The task a file's row gives (its reference checked by `reference_problem`), with what
        the environment derives from the reference: a sandbox `setup` that hides a secret, the
        `files` of its workspace, defaults of optional fields. An environment whose `tasks(seed)`
        builds its tasks through it plays a file's tasks exactly as its own."""
        return Task(task_id, prompt, reference=dict(reference))

    @classmethod
    def template_for(cls, task: Task) -> TemplateSpec:
        """The template `task`'s sandboxes start from: `template`, unless the environment's
        tasks each bring their own (an SWE task's container image)."""
        return cls.template

    async def output(self) -> str | None:
        """What the episode produced, kept in its record beside the transcript (an SWE
        episode's diff); None when there is nothing beyond the transcript."""
        return None

    @classmethod
    def demonstrator(cls, task: Task, seed: int) -> Callable[[str], str] | None:
        """A scripted text policy for warm-start demonstrations (called with the prompt, then
        with each observation; returns the next turn's text), or None when the task has none."""
        return None

    @classmethod
    async def undefined_tools(cls, sandbox: SandboxVerbs) -> list[str]:
        """The Python tools (`run` None) that are not functions in `sandbox`, a fresh sandbox
        of the template: each call of one would only ever answer an error."""
        names = [t.name for t in cls.tools if t.run is None]
        r = await sandbox.run_python(
            f"print(*[n for n in {names!r} if not callable(globals().get(n))])",
            timeout_s=cls.tool_timeout_s,
        )
        if not r.ok:
            raise RuntimeError(f"{cls.name}: looking for the tools failed: {r.text()}")
        return r.stdout.decode().split()

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """The tools as the model is shown them: {"name", "description", "parameters"} each."""
        return [t.schema() for t in cls.tools]

    async def reset(self) -> list[Message]:
        """The opening messages: the instructions, then the task. The tools are announced by
        the chat template, or after the instructions for one that does not know tools
        (`agent_loop.ChatFormat`)."""
        return [
            {"role": "system", "content": self.instructions},
            {"role": "user", "content": self.task.prompt},
        ]

    def model_turn(self, turn: ModelTurn) -> None:  # noqa: B027 (a hook, optional)
        """Told before each `step` how the engine produced its turn (an environment that
        answers a client in an inference API's terms reports it); nothing to do by default."""

    async def step(self, action_text: str) -> StepResult:
        """Run the tool calls of one model turn and return what the model sees next."""
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended")
        self.turns += 1
        calls = self.tool_parser.parse(action_text, self.tool_schemas())
        if not calls:
            self.done = True
            return StepResult(None, True)
        answers: list[str] = []
        errors = 0
        for number, call in enumerate(calls, 1):
            if number > self.max_tool_calls_per_turn:
                text, failed = (
                    f"error: only {self.max_tool_calls_per_turn} tool calls run per turn;"
                    f" call #{number} was skipped",
                    True,
                )
            else:
                text, failed = await self._answer(call)
            errors += failed
            answers.append(text)
        ended = self.ended(answers)
        truncated = not ended and self.turns >= self.max_turns
        self.done = ended or truncated
        if self.done:
            return StepResult(None, True, len(calls), errors, truncated)
        clipped = tuple(clip_response(a, self.max_observation_chars) for a in answers)
        responses = (format_tool_response(a, self.max_observation_chars) for a in answers)
        return StepResult("\n".join(responses), False, len(calls), errors, truncated, clipped)

    async def close(self) -> None:  # noqa: B027 (a hook: most environments hold nothing more)
        """Let go of what the episode holds beyond its sandbox (a harness's process): called
        once the episode is over, however it ended."""

    def ended(self, answers: list[str]) -> bool:
        """Whether the task's rules end the episode after a turn whose tool calls were answered
        `answers` (a game lost with no moves left): no turn follows, since none could change the
        reward, and the model is not trained on turns played after the outcome was settled."""
        return False

    async def _answer(self, call: ToolCall | ToolCallError) -> tuple[str, bool]:
        """(response text, whether it is an error) for one call; only InfraFailure escapes."""
        if isinstance(call, ToolCallError):
            return f"error: {call.message}", True
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            known = ", ".join(t.name for t in self.tools)
            return f"error: unknown tool {call.name!r}; the tools are: {known}", True
        problem = tool.argument_problem(call.arguments)
        if problem is not None:
            return f"error: {tool.name}: {problem}", True
        # Said the moment it happens, not minutes later when the agent loop's step limit ends
        # the episode: a tool (a user's async `run`) that ignores its timeout stalls its episode.
        overrun = asyncio.get_running_loop().call_later(
            self.tool_timeout_s + TOOL_OVERRUN_GRACE_S, self._warn_overrun, tool.name
        )
        try:
            if tool.run is not None:
                return await tool.run(self.sandbox, call.arguments, self.tool_timeout_s), False
            return await self._run_python_tool(tool.name, call.arguments)
        except InfraFailure:
            raise
        except Exception as e:  # the tool's own failure (a bad path, a bug): the model sees it
            return f"error: {tool.name} failed: {type(e).__name__}: {e}", True
        finally:
            overrun.cancel()

    def _warn_overrun(self, tool: str) -> None:
        trajectory = _trajectory.get()
        log.warning(
            "%s: tool %r%s is still running %g s after it was called, past its %g s timeout"
            " (%s.tool_timeout_s): a tool must bound its own waits by the timeout it is given;"
            " the agent loop ends the step at rollout.step_timeout_s",
            self.name,
            tool,
            f" of trajectory {trajectory}" if trajectory else " (outside any trajectory)",
            self.tool_timeout_s + TOOL_OVERRUN_GRACE_S,
            self.tool_timeout_s,
            type(self).__name__,
        )

    async def _run_python_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        # One expression, so the call leaves no names behind in the sandbox's globals.
        source = (
            "print((lambda r: r if isinstance(r, str) else __import__('json').dumps(r))"
            f"({name}(**__import__('json').loads({json.dumps(arguments)!r}))))"
        )
        r = await self.sandbox.run_python(source, timeout_s=self.tool_timeout_s)
        if r.timed_out:
            return f"error: {name} timed out after {self.tool_timeout_s:g} s", True
        if r.exit_code != 0:
            # The traceback's last line ("ValueError: n must be ...") is what the model can act on.
            lines = r.stderr.decode(errors="replace").strip().splitlines()
            return f"error: {name} raised {lines[-1] if lines else f'exit {r.exit_code}'}", True
        return r.text().removesuffix("\n"), False


class EnvironmentFailed(Exception):
    """The environment's own code (its reset, step, output or reward) raised: a bug of its
    author's, neither the model's turn nor the platform. The episode is not trained on; the
    exception it raised is the cause, with the traceback its author needs, and `record` the
    episode as far as it went (its turns and output, for the author to look at), once the agent
    loop has one."""

    record: Trajectory | None = None


@contextlib.contextmanager
def raised_by(env: Environment | type[Environment], verb: str, where: str = "") -> Iterator[None]:
    """An exception of the environment's own code becomes `EnvironmentFailed`, naming it (and
    `where`: the task and the trajectory, for a reward scored away from its episode)."""
    try:
        yield
    except (InfraFailure, TimeoutError):
        raise
    except Exception as e:
        raise EnvironmentFailed(f"{env.name}.{verb}{where} raised {type(e).__name__}: {e}") from e


async def environment_call(
    env: Environment | type[Environment], verb: str, call: Awaitable[T], where: str = ""
) -> T:
    with raised_by(env, verb, where):
        return await call


def checked_reward(env: Environment | type[Environment], reward: object, where: str = "") -> float:
    """A NaN would poison the advantages, and through them the weights, without an error."""
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvironmentFailed(
            f"{env.name}.reward{where} returned {reward!r}: a reward is a finite number"
        )
    return float(reward)
