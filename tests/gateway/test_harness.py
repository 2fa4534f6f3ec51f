"""An unmodified agent harness (OpenAI's client, or Anthropic's Messages API over HTTP) plays
episodes through the gateway, recorded token for token as the engine sampled them."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests import chat_templates
from tests.runtime import SMALL
from venusrl.config import load_config
from venusrl.coordinator.agent_loop import ChatFormat, run_episode
from venusrl.coordinator.config import RolloutConfig
from venusrl.envs.pool import SandboxPool
from venusrl.gateway.harness import HarnessRun
from venusrl.gateway.server import Gateway
from venusrl.gateway.session import Session
from venusrl.runtime.record import read_records
from venusrl.runtime.train import train
from venusrl.server.errors import ApiError
from venusrl.types import (
    FailureKind,
    Finish,
    GenerationOutput,
    SamplingParams,
    Trajectory,
    TurnMeta,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from harness_agent.env import AddingAgent  # noqa: E402


class Scripted:
    """The engine's side, scripted: each turn answers the next text, as token ids; the turns
    numbered in `cut` stop at their token limit, without an end of turn."""

    def __init__(self, tok: Any, texts: Sequence[str], cut: Sequence[int] = ()) -> None:
        self.tok, self.texts, self.cut = tok, list(texts), set(cut)
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def __call__(
        self, prompt: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        cut = len(self.prompts) in self.cut
        ids = self.tok.encode(self.texts[len(self.prompts)])
        ids += [] if cut else list(self.tok.eos_token_ids)
        self.prompts.append(prompt)
        self.sampled.append(ids)
        n = len(ids)
        reason = "length" if cut else "stop"
        return GenerationOutput("r", prompt, ids, [-0.5] * n, [3] * n, reason, 0)


class Agent(AddingAgent):
    """The example's environment, keeping what its harness did."""

    runs: ClassVar[list[HarnessRun]] = []

    async def score(self, run: HarnessRun) -> float:
        Agent.runs.append(run)
        return await super().score(run)


def episode(
    env: type[AddingAgent],
    engine: Scripted,
    fmt: ChatFormat,
    replay: Trajectory | None = None,
    **limits: Any,
) -> Trajectory:
    task = next(env.tasks(seed=0))
    rollout = RolloutConfig(max_context=4096, max_tokens_per_turn=256, **limits)
    # The harness's reward reads its output, not the sandbox: no sandbox is needed.
    return asyncio.run(
        run_episode(
            env(task, None),  # type: ignore[arg-type]
            engine,
            fmt,
            SamplingParams(),
            rollout,
            "t",
            "g",
            task.id,
            replay=replay,
        )
    )


def test_an_openai_client_agent_is_recorded_as_sampled_where_the_template_rewrites_history() -> (
    None
):
    """Qwen3's template drops the `<think>` of earlier turns: rendering the conversation again
    would train the model on a prompt it never saw. The record keeps each turn's tokens and puts
    only the harness's new messages (its nudge, then the tool's result) after them."""
    tok = chat_templates.tokenizer("qwen3")
    fmt = ChatFormat(tok)
    task = next(AddingAgent.tasks(seed=0))
    a, b = (int(w.strip("?")) for w in task.prompt.split()[2::2])
    call = fmt.tool_parser.format_call("add", {"a": a, "b": b})
    said = [
        "<think>I add them.</think>\n\nIt is about 100.",
        f"<think>With the tool.</think>\n\n{call}",
        f"<think>Done.</think>\n\nThe sum is {a + b}.",
    ]
    engine = Scripted(tok, said)
    Agent.runs.clear()
    traj = episode(Agent, engine, fmt)

    assert traj.finish is Finish.DONE and traj.reward == 1.0
    assert len(traj.turn_starts) == 3  # the harness's three requests, one model turn each
    for start, ids in zip(traj.turn_starts, engine.sampled, strict=True):
        assert traj.token_ids[start : start + len(ids)] == ids  # as sampled, with their logprobs
        assert traj.logprobs[start : start + len(ids)] == [-0.5] * len(ids)
    # Each turn's prompt is the record so far: never re-rendered, so the cache holds its prefix.
    for start, prompt in zip(traj.turn_starts, engine.prompts, strict=True):
        assert prompt == traj.token_ids[:start]
    record = tok.decode(traj.token_ids, skip_special_tokens=False)
    assert record.count("<think>I add them.</think>") == 1
    assert f"<tool_response>\n{a + b}\n</tool_response>" in record
    assert "Use the add tool, then say the sum." in record
    # What the template would make of the same conversation: the first turn's thinking gone.
    run = Agent.runs[0]
    assert run.returncode == 0 and run.stdout.strip().endswith(f"\n\nThe sum is {a + b}.")
    assert [m["role"] for m in run.messages] == [
        "system", "user", "assistant", "user", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert run.messages[4]["tool_calls"][0]["function"]["arguments"] == {"a": a, "b": b}
    rendered = chat_templates.transformers_tokenizer("qwen3").apply_chat_template(
        run.messages[:-1],
        tools=[t for t in json.loads(json.dumps(_agent_tools()))],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "I add them." not in rendered and "I add them." in record


def _agent_tools() -> list[dict[str, Any]]:
    from harness_agent.agent import TOOLS

    return TOOLS


def harness_env(tmp_path: Path, source: str, **attributes: Any) -> type[Agent]:
    """The example's task family, played by the harness `source` (a Python script using httpx,
    as a harness in another language would speak HTTP)."""
    script = tmp_path / "harness.py"
    script.write_text(source)
    command = lambda self: [sys.executable, str(script)]  # noqa: E731
    return type("Harness", (Agent,), {"command": command, **attributes})


ANTHROPIC_HARNESS = """
import json, os, httpx
url = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages"
tools = [{"name": "add", "description": "a + b", "input_schema": {"type": "object",
          "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
messages = [{"role": "user", "content": os.environ["VENUSRL_TASK_PROMPT"]}]
while True:
    body = {"model": "policy", "max_tokens": 64, "system": "Add.", "messages": list(messages),
            "tools": tools}
    reply = httpx.post(url, json=body, headers={"x-api-key": os.environ["ANTHROPIC_API_KEY"]},
                       timeout=60).json()
    messages.append({"role": "assistant", "content": reply["content"]})
    uses = [b for b in reply["content"] if b["type"] == "tool_use"]
    if reply["stop_reason"] != "tool_use":
        # The answer again, streamed: a resend of a conversation gets the answer it got.
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=60).text
        events = [json.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        text = "".join(e["delta"].get("text", "") for e in events
                       if e["type"] == "content_block_delta")
        assert text == reply["content"][0]["text"], (text, reply)
        counted = [e["usage"] for e in events if e["type"] == "message_delta"]
        assert counted == [{"output_tokens": reply["usage"]["output_tokens"]}], counted
        print(reply["usage"]["input_tokens"], reply["usage"]["output_tokens"])
        print(text)
        break
    results = [{"type": "tool_result", "tool_use_id": u["id"],
                "content": str(u["input"]["a"] + u["input"]["b"])} for u in uses]
    reminder = {"type": "text", "text": "Now say the sum."}  # after the results, as harnesses do
    messages.append({"role": "user", "content": [*results, reminder]})
"""


def test_an_anthropic_messages_harness_is_recorded_with_its_tool_results(tmp_path: Path) -> None:
    tok = chat_templates.tokenizer("qwen3")
    fmt = ChatFormat(tok)
    task = next(AddingAgent.tasks(seed=0))
    a, b = (int(w.strip("?")) for w in task.prompt.split()[2::2])
    call = fmt.tool_parser.format_call("add", {"a": a, "b": b})
    engine = Scripted(tok, [call, f"The sum is {a + b}."])
    Agent.runs.clear()
    traj = episode(harness_env(tmp_path, ANTHROPIC_HARNESS), engine, fmt)
    assert traj.finish is Finish.DONE and traj.reward == 1.0 and traj.tool_calls == 1
    # The harness is told the tokens of the turn's prompt and its own, as the engine ran them.
    told = Agent.runs[0].stdout.splitlines()[0]
    assert told == f"{len(engine.prompts[-1])} {len(engine.sampled[-1])}"
    record = tok.decode(traj.token_ids, skip_special_tokens=False)
    assert record.startswith("<|im_start|>system\nAdd.\n\n# Tools")  # the opening, rendered once
    answered = f"<tool_response>\n{a + b}\n</tool_response><|im_end|>\n"
    assert f"{answered}<|im_start|>user\nNow say the sum.<|im_end|>\n" in record
    for start, prompt in zip(traj.turn_starts, engine.prompts, strict=True):
        assert prompt == traj.token_ids[:start]


COUNTING_HARNESS = """
import openai
client = openai.OpenAI()
messages = [{"role": "user", "content": "Add 1 and 1."}]
reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
done = reply.choices[0]
print(done.finish_reason, reply.usage.prompt_tokens, reply.usage.completion_tokens)
messages += [done.message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
chunks = list(client.chat.completions.create(
    model="policy", messages=messages, stream=True, stream_options={"include_usage": True}))
usage = chunks[-1].usage
print(chunks[-2].choices[0].finish_reason, usage.prompt_tokens, usage.completion_tokens)
"""


def test_an_openai_client_is_told_its_turns_usage_and_a_turn_cut_at_its_limit_is_length(
    tmp_path: Path,
) -> None:
    tok = chat_templates.tokenizer("qwen3")
    engine = Scripted(tok, ["1 + 1 is", "2."], cut=[0])
    Agent.runs.clear()
    traj = episode(harness_env(tmp_path, COUNTING_HARNESS), engine, ChatFormat(tok))
    assert traj.finish is Finish.DONE and traj.cut_turns == [0]
    run = Agent.runs[0]
    assert run.returncode == 0, run.stderr
    told = [line.split() for line in run.stdout.splitlines()]
    assert told == [
        [reason, str(len(prompt)), str(len(sampled))]
        for reason, prompt, sampled in zip(
            ["length", "stop"], engine.prompts, engine.sampled, strict=True
        )
    ]
    # Played again from its record (its sandbox lost), the harness is told the same.
    replayed = episode(harness_env(tmp_path, COUNTING_HARNESS), engine, ChatFormat(tok), traj)
    assert replayed.token_ids == traj.token_ids and replayed.cut_turns == [0]
    assert Agent.runs[1].stdout == run.stdout


REWRITING_HARNESS = """
import os, httpx
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 1?"}]
first = httpx.post(url, json={"messages": messages}, timeout=60).json()["choices"][0]["message"]
# A harness that summarises its history: the model never saw this user message.
messages[1]["content"] = "(summarised)"
again = httpx.post(url, json={"messages": [*messages, first, {"role": "user", "content": "?"}]},
                   timeout=60)
print(again.status_code, again.json()["error"]["message"])
"""


def test_a_harness_that_rewrites_its_history_is_told_which_message_and_its_episode_is_dropped(
    tmp_path: Path,
) -> None:
    tok = chat_templates.tokenizer("qwen3")
    env = harness_env(tmp_path, REWRITING_HARNESS)
    with pytest.raises(Exception, match=r"messages\[1\] is not the user message") as raised:
        episode(env, Scripted(tok, ["2", "2"]), ChatFormat(tok))
    assert type(raised.value).__name__ == "EnvironmentFailed"  # the run masks it, and goes on


STALLING_HARNESS = """
import os, subprocess, sys, time, httpx
# A child that would outlive it, holding its output open: stopped with it.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
messages = [{"role": "user", "content": "Add 1 and 1."}]
first = httpx.post(url, json={"messages": messages}, timeout=60).json()["choices"][0]["message"]
print("asked", flush=True)
time.sleep(600)  # a tool that never returns
"""


def test_a_harness_stalling_in_a_tool_is_stopped_with_its_children_at_the_step_limit(
    tmp_path: Path,
) -> None:
    """The harness's tools run between its requests: a step is the time until its next one."""
    tok = chat_templates.tokenizer("qwen3")
    env = harness_env(tmp_path, STALLING_HARNESS, exit_grace_s=0.5)
    traj = episode(env, Scripted(tok, ["2"]), ChatFormat(tok), step_timeout_s=2.0)
    assert traj.finish is Finish.INFRA and traj.failed_with(FailureKind.TIMEOUT)
    assert "step_timeout_s" in str(traj.failure) and len(traj.turn_starts) == 1
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(600\\)"], capture_output=True)
    assert left.stdout == b""  # the harness and the child it started are gone


def test_a_harness_that_exits_before_asking_fails_its_episode_with_its_stderr(
    tmp_path: Path,
) -> None:
    tok = chat_templates.tokenizer("qwen3")
    env = harness_env(tmp_path, "import sys; sys.exit('no OPENAI_BASE_URL for me')")
    with pytest.raises(
        Exception, match=r"exited with status 1 before its first request.*no OPENAI"
    ):
        episode(env, Scripted(tok, []), ChatFormat(tok))


SANDBOXED_HARNESS = """
import os, httpx
exec_url = os.environ["VENUSRL_SANDBOX_URL"] + "/exec"
def run(**body):
    return httpx.post(exec_url, json=body, timeout=60)
probe = "/tmp/venusrl-harness-probe"
made = run(command=f"echo $((2 + 3)) > {probe} && cat {probe}").json()
print(made["exit_code"], made["stdout"].strip(), os.path.exists(probe))
print(run(command=["sleep", "5"], timeout_s=0.5).json()["timed_out"])
bad = run(command="true", timeout_s=-1)
print(bad.status_code, bad.json()["error"]["message"])
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
reply = httpx.post(url, json={"messages": [{"role": "user", "content": "2 + 3?"}]}, timeout=60)
print(reply.json()["choices"][0]["message"]["content"])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")
def test_a_harness_runs_its_tools_commands_in_the_episode_s_sandbox(tmp_path: Path) -> None:
    tok = chat_templates.tokenizer("qwen3")
    env = harness_env(tmp_path, SANDBOXED_HARNESS)
    task = next(env.tasks(seed=0))
    rollout = RolloutConfig(max_context=4096, max_tokens_per_turn=256)

    async def main() -> Trajectory:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(env.template)
            sb = await pool.create(env.template.name)
            try:
                return await run_episode(env(task, sb), Scripted(tok, ["5"]), ChatFormat(tok),
                                         SamplingParams(), rollout, "t", "g", task.id)  # fmt: skip
            finally:
                await sb.close()

    Agent.runs.clear()
    traj = asyncio.run(main())
    assert traj.finish is Finish.DONE
    run = Agent.runs[0]
    assert run.returncode == 0, run.stderr
    made, slow, bad, answer = run.stdout.splitlines()
    # Written and read in the sandbox; the harness's own /tmp never saw the file.
    assert made == "0 5 False"
    assert slow == "True"  # the command's own time limit
    assert bad.startswith("400 ") and "timeout_s" in bad
    assert answer == "5"


def test_a_sandbox_command_is_refused_without_a_sandbox_and_once_the_episode_ended() -> None:
    async def main() -> list[tuple[int, str]]:
        refused = []
        for session in (Session(), Session()):
            if refused:
                session.end("the episode is over")
            with pytest.raises(ApiError) as raised:
                await session.run("true", timeout_s=1.0, max_output_bytes=100)
            refused.append((raised.value.status, raised.value.message))
        return refused

    (none, ended) = asyncio.run(main())
    assert none == (409, "this episode has no sandbox")
    assert ended[0] == 410 and ended[1].endswith("the episode is over")


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")
def test_venusrl_train_trains_on_the_episodes_of_an_openai_client_harness(tmp_path: Path) -> None:
    """The example (examples/harness-agent.yaml): every episode is the harness's own loop of
    up to three requests, recorded and trained."""
    overrides = [
        *SMALL,
        f"rollout.env={ROOT}/examples/harness_agent/env.py:AddingAgent",
        "run.warm_start_episodes=0",
        "run.steps=2",
    ]
    metrics = asyncio.run(train(load_config(None, overrides), tmp_path))
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    records = list(read_records(tmp_path))
    assert len(records) == 2 * 2 * 2 and {r["env"] for r in records} == {"adding_agent"}
    assert all(r["finish"] == "done" for r in records)
    # A random policy never calls the tool: the harness nudged it, three turns each.
    assert all(len(r["turn_starts"]) == 3 for r in records)


RESENDING_HARNESS = """
import os, threading, httpx
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
body = {"messages": [{"role": "user", "content": "Add 1 and 1."}]}
# The same request twice at once (a client that timed out and retried): one turn, one answer.
answers = [None, None]
def ask(i):
    answers[i] = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
assert answers[0] == answers[1], answers
# And again after it was answered: the same answer, no new turn.
again = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
assert again == answers[0], (again, answers)
big = httpx.post(url, content=b"x" * (33 << 20), timeout=60)
print(big.status_code, big.json()["error"]["message"][:27])
# A child that outlives the harness, holding nothing of the gateway's: killed with its group.
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(601)"])
print(again["content"])
"""


def test_a_resent_request_gets_one_turn_and_a_harness_that_exits_leaving_a_child_is_done(
    tmp_path: Path,
) -> None:
    tok = chat_templates.tokenizer("qwen3")
    Agent.runs.clear()
    traj = episode(harness_env(tmp_path, RESENDING_HARNESS), Scripted(tok, ["2"]), ChatFormat(tok))
    assert traj.finish is Finish.DONE and len(traj.turn_starts) == 1
    run = Agent.runs[0]
    assert run.returncode == 0, run.stderr
    refused, answer = run.stdout.splitlines()
    assert refused.startswith("413 the body may be at most") and answer == "2"
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(601\\)"], capture_output=True)
    assert left.stdout == b""


def test_a_harness_that_never_asks_is_stopped_at_its_start_timeout(tmp_path: Path) -> None:
    tok = chat_templates.tokenizer("qwen3")
    env = harness_env(
        tmp_path, "import time; time.sleep(602)", start_timeout_s=1.0, exit_grace_s=0.5
    )
    with pytest.raises(TimeoutError):
        episode(env, Scripted(tok, []), ChatFormat(tok))
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(602\\)"], capture_output=True)
    assert left.stdout == b""
    assert not Gateway.shared().sessions  # every episode's session closed with it
