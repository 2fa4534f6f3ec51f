"""How an environment answers each tool call, good or bad (the formats: test_tool_formats.py).

The environment tests here run against an in-process stand-in for a sandbox (no root needed); the
built-in environments are played against the real pool in test_builtin_envs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from venusrl.envs.environment import Environment, SandboxVerbs, Task, Tool
from venusrl.envs.types import ExecResult, SandboxCrashed, SandboxError, TemplateSpec
from venusrl.model.tool_formats import tool_parser


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --- how an environment answers calls (in-process stand-in for a sandbox) ----------------------


class InProcessSandbox:
    """Runs `run_python` with exec() in this process; what a sandbox promises, without isolation."""

    def __init__(self, setup: str) -> None:
        self.globals: dict[str, Any] = {}
        exec(setup, self.globals)

    def _run(self, source: str) -> ExecResult:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(source, self.globals)
                code = 0
            except Exception:
                err.write(traceback.format_exc())
                code = 1
        return ExecResult(code, out.getvalue().encode(), err.getvalue().encode())

    async def run_python(self, source: str, /, *, timeout_s: float) -> ExecResult:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._run, source), timeout_s)
        except TimeoutError:
            return ExecResult(124, b"", b"", timed_out=True)

    async def exec(
        self,
        command: str | Sequence[str],
        /,
        *,
        timeout_s: float,
        max_output_bytes: int,
        stdin: bytes = b"",
    ) -> ExecResult:
        raise NotImplementedError

    async def read_file(self, path: str, /) -> bytes:
        raise SandboxError(f"path must stay inside the workspace, got {path!r}")

    async def write_file(self, path: str, data: bytes, /) -> None:
        raise NotImplementedError


_SETUP = """
import time

def echo(text, times=1):
    return text * times

def stats(xs):
    return {"n": len(xs), "sum": sum(xs)}

def boom():
    raise ValueError("the tool broke")

def nap():
    time.sleep(0.5)
"""


async def _read(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    return (await sandbox.read_file(arguments["path"])).decode()


async def _crash(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    raise SandboxCrashed("sandbox 7 crashed")


class Toolbox(Environment):
    name = "toolbox"
    template = TemplateSpec(name="toolbox", setup=_SETUP)
    instructions = "Use the tools."
    tools = (
        Tool(
            "echo",
            "Repeat text.",
            {
                "type": "object",
                "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
                "required": ["text"],
            },
        ),
        Tool("stats", "Count and sum.", {"type": "object", "properties": {"xs": {}}}),
        Tool("boom", "Always fails."),
        Tool("nap", "Sleeps past the timeout."),
        Tool("read", "Read a file.", {"type": "object", "properties": {"path": {}}}, _read),
        Tool("crash", "The platform fails.", run=_crash),
    )
    max_turns = 3
    max_tool_calls_per_turn = 3
    tool_timeout_s = 0.05
    max_observation_chars = 200

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        yield Task(id="only", prompt="Go.")

    async def reward(self) -> float:
        return 0.0


def toolbox() -> Toolbox:
    return Toolbox(Task(id="t", prompt="Go."), InProcessSandbox(_SETUP))


def test_reset_gives_the_instructions_then_the_task_and_the_tools_apart():
    """The tools go to the chat template (or its system message) beside the messages."""
    system, user = asyncio.run(toolbox().reset())
    assert system == {"role": "system", "content": "Use the tools."}
    assert user == {"role": "user", "content": "Go."}
    assert [t["name"] for t in Toolbox.tool_schemas()] == [t.name for t in Toolbox.tools]


def test_an_environment_reads_calls_in_the_format_it_is_given_typed_by_its_tools():
    env = toolbox()
    env.tool_parser = tool_parser("qwen3_coder")
    turn = env.tool_parser.format_call("echo", {"text": "ab", "times": 2})
    assert "<parameter=times>\n2\n</parameter>" in turn  # text, converted by the schema
    result = asyncio.run(env.step(turn))
    assert result.tool_responses == ("abab",)
    assert result.observation == "<tool_response>\nabab\n</tool_response>"


def test_python_tool_results_come_back_as_text_or_json_in_call_order():
    result = asyncio.run(
        toolbox().step(call("echo", text="ab", times=2) + call("stats", xs=[1, 2]))
    )
    assert result.observation == (
        '<tool_response>\nabab\n</tool_response>\n<tool_response>\n{"n": 2, "sum": 3}\n'
        "</tool_response>"
    )
    assert result.tool_responses == ("abab", '{"n": 2, "sum": 3}')
    assert not result.done
    assert (result.tool_calls, result.tool_errors, result.truncated) == (2, 0, False)


@pytest.mark.parametrize(
    ("action", "says"),
    [
        ("<tool_call>{oops</tool_call>", "error: tool call #1: invalid JSON at line 1 column 2"),
        (call("shout"), "error: unknown tool 'shout'; the tools are: echo, stats, boom"),
        (
            call("echo", txt="a"),
            "error: echo: unknown argument 'txt'; echo takes ['text', 'times']",
        ),
        (call("echo"), "error: echo: missing required argument 'text'"),
        (call("echo", text=3), "error: echo: argument 'text' must be string, got a number"),
        (call("boom"), "error: boom raised ValueError: the tool broke"),
        (call("nap"), "error: nap timed out after 0.05 s"),
        (call("read", path="../x"), "error: read failed: SandboxError: path must stay inside"),
    ],
)
def test_each_kind_of_bad_call_is_an_error_observation_and_the_episode_goes_on(
    action: str, says: str
):
    env = toolbox()
    result = asyncio.run(env.step(action))
    assert result.observation is not None and result.observation.startswith(
        f"<tool_response>\n{says}"
    )
    assert not result.done and result.tool_errors == 1
    after = asyncio.run(env.step(call("echo", text="still here")))
    assert after.observation == "<tool_response>\nstill here\n</tool_response>"


def test_infra_failure_is_raised_for_the_caller_to_retry():
    with pytest.raises(SandboxCrashed):
        asyncio.run(toolbox().step(call("crash")))


def test_calls_past_the_per_turn_cap_are_skipped_with_a_message():
    result = asyncio.run(toolbox().step(call("echo", text="x") * 4))
    assert result.observation is not None
    assert result.observation.count("<tool_response>\nx\n") == 3
    assert "error: only 3 tool calls run per turn; call #4 was skipped" in result.observation
    assert (result.tool_calls, result.tool_errors, result.truncated) == (4, 1, False)


def test_long_tool_output_is_capped():
    result = asyncio.run(toolbox().step(call("echo", text="y", times=1000)))
    assert result.observation is not None
    assert "[... 800 characters cut ...]" in result.observation
    assert len(result.observation) < 300


def test_a_turn_without_tool_calls_ends_the_episode():
    env = toolbox()
    result = asyncio.run(env.step("I am done."))
    assert result.done and result.observation is None and not result.truncated
    with pytest.raises(RuntimeError, match="after the episode ended"):
        asyncio.run(env.step(call("echo", text="x")))


def test_the_turn_cap_runs_the_last_turn_then_ends_truncated():
    env = toolbox()
    for _ in range(Toolbox.max_turns - 1):
        assert not asyncio.run(env.step(call("echo", text="x"))).done
    last = asyncio.run(env.step(call("echo", text="x")))
    assert last.done and last.observation is None
    assert (last.tool_calls, last.tool_errors, last.truncated) == (1, 0, True)


def test_python_tool_calls_leave_no_names_in_the_sandbox_globals():
    env = toolbox()
    sandbox = env.sandbox
    assert isinstance(sandbox, InProcessSandbox)
    before = set(sandbox.globals)
    asyncio.run(env.step(call("echo", text="x")))
    assert set(sandbox.globals) == before
