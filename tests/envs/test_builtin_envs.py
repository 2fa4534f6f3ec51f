"""The built-in environments, played end to end by scripted policies in real sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import pytest

from venusrl.envs import SandboxPool
from venusrl.envs.builtin import BUILTIN
from venusrl.envs.builtin.agent_workload import TIME_SCALE, AgentWorkload
from venusrl.envs.builtin.guess_number import (
    MAX_GUESSES,
    BinarySearchExpert,
    GuessNumber,
    RandomGuesser,
)
from venusrl.envs.builtin.math_python import MathPython
from venusrl.envs.builtin.swe import Swe
from venusrl.envs.builtin.swe_mini import CheatByDeletingTests, ScriptedFixer, SweMini
from venusrl.envs.builtin.treasure_hunt import (
    CELLS,
    MAX_CELLS,
    MIN_CELLS,
    SLACK,
    TASK_FILE,
    TASK_FILE_ROWS,
    TASK_FILE_SEED,
    TrailFollower,
    TreasureHunt,
)
from venusrl.envs.environment import Environment, StepResult, Task, Tool
from venusrl.envs.task_file import read_task_file

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="sandboxes need root for namespaces and cgroups"
)

T = TypeVar("T")
Episode = tuple[float, list[StepResult]]  # (reward, steps)


def with_pool(env: type[Environment], body: Callable[[SandboxPool], Awaitable[T]]) -> T:
    async def main() -> T:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(env.template)
            return await body(pool)

    return asyncio.run(main())


async def play(env: Environment, policy: Callable[[str], str]) -> Episode:
    """Feed the policy the prompt, then each observation, until the episode ends; then score."""
    observation = (await env.reset())[-1]["content"]
    steps: list[StepResult] = []
    while True:
        result = await env.step(policy(observation))
        steps.append(result)
        if result.done:
            return await env.reward(), steps
        assert result.observation is not None
        observation = result.observation


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def secret_of(task: Task) -> int:
    return int(task.setup.removeprefix("secret = "))


def test_builtin_registry_names_each_environment_once():
    assert {
        "treasure_hunt": TreasureHunt,
        "guess_number": GuessNumber,
        "swe_mini": SweMini,
        "swe": Swe,
        "math_python": MathPython,
        "agent_workload": AgentWorkload,
    } == BUILTIN


@pytest.mark.parametrize("env", [TreasureHunt, GuessNumber, SweMini])
def test_same_seed_same_tasks(env: type[Environment]):
    def contents(seed: int) -> list[tuple[str, dict[str, bytes]]]:
        return [(t.setup, dict(t.files)) for t in islice(env.tasks(seed), 5)]

    assert list(islice(env.tasks(3), 5)) == list(islice(env.tasks(3), 5))
    assert contents(3) != contents(4)


# --- treasure_hunt -----------------------------------------------------------------------------


def test_treasure_hunt_prompt_names_only_the_first_cell_of_the_trail():
    tasks = list(islice(TreasureHunt.tasks(0), 50))
    for t in tasks:
        trail = t.reference["trail"]
        assert MIN_CELLS <= len(trail) <= MAX_CELLS and len(set(trail)) == len(trail)
        assert f"opening cell {trail[0]}:" in t.prompt
        numbers = [int(n) for n in re.findall(r"\d+", t.prompt)]
        assert numbers == [CELLS, trail[0], len(trail) + SLACK]  # no other cell of the trail
        assert f"trail = {trail}" in t.setup
    assert {len(t.reference["trail"]) for t in tasks} == set(range(MIN_CELLS, MAX_CELLS + 1))


def test_treasure_hunt_is_won_by_following_every_clue_and_lost_by_ignoring_them():
    task = next(TreasureHunt.tasks(1))
    trail = task.reference["trail"]
    stray = next(c for c in range(1, CELLS + 1) if c not in trail)

    def ignoring(observation: str) -> str:  # opens the first cell, then one cell over and over
        return call("open_cell", cell=trail[0] if "clue" not in observation else stray)

    async def body(pool: SandboxPool) -> tuple[Episode, Episode]:
        group = await pool.create_group(TreasureHunt.template.name, 2, setup=task.setup)
        try:
            return await asyncio.gather(
                play(TreasureHunt(task, group[0]), TrailFollower(trail[0], random.Random(0))),
                play(TreasureHunt(task, group[1]), ignoring),
            )
        finally:
            await group.close()

    (won, won_steps), (lost, lost_steps) = with_pool(TreasureHunt, body)
    assert won == 1.0 and len(won_steps) == len(trail) >= 3
    assert sum(s.tool_calls for s in won_steps) == len(trail)
    assert lost == 0.0
    # Out of opens (the trail's length and the slack) ends the game, not the turn cap.
    assert len(lost_steps) == len(trail) + SLACK and not lost_steps[-1].truncated


def test_treasure_hunt_tasks_read_from_its_shipped_file_are_those_of_its_stream():
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_treasure_hunt_tasks.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Same id, prompt, sandbox setup and reference (whence the same reward and demonstrator).
    from_file = read_task_file(TASK_FILE, TreasureHunt)
    assert from_file == list(islice(TreasureHunt.tasks(TASK_FILE_SEED), TASK_FILE_ROWS))
    assert all(t.setup.startswith("trail = [") for t in from_file)


def test_a_treasure_hunt_task_from_a_file_is_played_in_a_sandbox_set_up_from_its_row(
    tmp_path: Path,
):
    # No slack: `opens` from the row, not the default, reaches the sandbox and the game's end.
    row = {
        "id": "tight",
        "prompt": "Start by opening cell 40.",
        "trail": [40, 2, 63, 17],
        "opens": 4,
    }
    (tmp_path / "hunt.jsonl").write_text(json.dumps(row) + "\n")
    [task] = read_task_file(tmp_path / "hunt.jsonl", TreasureHunt)

    def rereading(observation: str) -> str:  # opens the first clue's cell, then that one again
        return call("open_cell", cell=2 if "clue" in observation else 40)

    async def body(pool: SandboxPool) -> tuple[Episode, Episode]:
        group = await pool.create_group(TreasureHunt.template.name, 2, setup=task.setup)
        try:
            return await asyncio.gather(
                play(TreasureHunt(task, group[0]), TrailFollower(40, random.Random(0))),
                play(TreasureHunt(task, group[1]), rereading),
            )
        finally:
            await group.close()

    (won, won_steps), (lost, lost_steps) = with_pool(TreasureHunt, body)
    assert won == 1.0 and len(won_steps) == 4
    assert lost == 0.0 and len(lost_steps) == 4  # out of opens after 4, not 4 + SLACK


def test_a_careless_trail_follower_copies_the_wrong_number_of_a_clue_at_its_rate():
    clue = "<tool_response>\nclue: cell 5 says the next clue is in cell 9\n</tool_response>"
    careless = TrailFollower(5, random.Random(0), slip=0.3)
    assert careless("") == call("open_cell", cell=5)  # the prompt's cell: nothing to mix up
    opened = Counter(careless(clue) for _ in range(2000))
    assert set(opened) == {call("open_cell", cell=9), call("open_cell", cell=5)}
    assert abs(opened[call("open_cell", cell=5)] / 2000 - 0.3) < 0.04
    careful = TrailFollower(5, random.Random(0))
    assert careful("") == call("open_cell", cell=5)
    assert all(careful(clue) == call("open_cell", cell=9) for _ in range(100))
    # A cell that was empty (a model's slip): the cell the last clue named is opened again.
    empty = "<tool_response>\nempty: cell 12 is empty\n</tool_response>"
    assert careful(empty) == call("open_cell", cell=9)


# --- guess_number ------------------------------------------------------------------------------


def test_guess_number_secret_is_in_the_sandbox_not_in_the_prompt():
    tasks = list(islice(GuessNumber.tasks(0), 20))
    assert len({secret_of(t) for t in tasks}) > 10
    assert len({t.prompt for t in tasks}) == 1  # one prompt for every secret
    assert all(f"secret = {secret_of(t)}" in t.setup for t in tasks)


def test_guess_number_expert_wins_with_several_calls_and_random_sibling_loses_on_its_last_guess():
    task = next(GuessNumber.tasks(1))
    guesser = RandomGuesser(seed=2)
    assert secret_of(task) not in guesser.guesses  # else it would win by luck
    assert secret_of(task) not in (32, 16, 48)  # else binary search needs fewer than 3 calls

    async def body(pool: SandboxPool) -> tuple[Episode, Episode]:
        group = await pool.create_group(GuessNumber.template.name, 2, setup=task.setup)
        try:
            # Siblings share the task's setup but not their state: each has its own guesses.
            return await asyncio.gather(
                play(GuessNumber(task, group[0]), BinarySearchExpert()),
                play(GuessNumber(task, group[1]), guesser),
            )
        finally:
            await group.close()

    (expert_reward, expert_steps), (random_reward, random_steps) = with_pool(GuessNumber, body)
    assert expert_reward == 1.0
    assert sum(s.tool_calls for s in expert_steps) >= 3
    assert not expert_steps[-1].truncated
    assert random_reward == 0.0
    assert sum(s.tool_calls for s in random_steps) == MAX_GUESSES
    # The game is lost with the last guess: the episode ends there, not at the turn cap.
    assert len(random_steps) == MAX_GUESSES
    assert random_steps[-1].done and not random_steps[-1].truncated


class NappingGuessNumber(GuessNumber):
    """GuessNumber plus a tool that sleeps past a short timeout."""

    tools = (*GuessNumber.tools, Tool("nap", "Sleeps for a long time."))
    tool_timeout_s = 1.0
    max_turns = GuessNumber.max_turns + 5  # room for the five bad turns below


def test_guess_number_bad_calls_become_observations_and_the_episode_goes_on():
    task = next(GuessNumber.tasks(0))
    task = Task(
        task.id, task.prompt, task.setup + "\nimport time\ndef nap():\n    time.sleep(30)\n"
    )

    async def body(pool: SandboxPool) -> tuple[list[str], Episode]:
        sandbox = await pool.create(GuessNumber.template.name, setup=task.setup)
        try:
            env = NappingGuessNumber(task, sandbox)
            await env.reset()
            observations = []
            for action in (
                call("shout", n=5),
                '<tool_call>{"name": "guess", "arguments": {"n": 5}</tool_call>',
                call("guess", n=1000),
                call("guess", m=5),
                call("nap"),
            ):
                result = await env.step(action)
                assert not result.done and result.observation is not None
                observations.append(result.observation)
            return observations, await play(env, BinarySearchExpert())
        finally:
            await sandbox.close()

    observations, (reward, steps) = with_pool(GuessNumber, body)
    assert "error: unknown tool 'shout'; the tools are: guess, nap" in observations[0]
    assert "error: tool call #1: invalid JSON at line 1" in observations[1]
    assert "error: guess raised ValueError: n must be between 1 and 63, got 1000" in observations[2]
    assert "error: guess: unknown argument 'm'; guess takes ['n']" in observations[3]
    assert "error: nap timed out after 1 s" in observations[4]
    assert reward == 1.0  # none of the bad calls used up a guess, and the interpreter survived
    assert steps[-1].done


# --- swe_mini ----------------------------------------------------------------------------------


def every_swe_variant() -> Iterator[Task]:
    seen = set()
    for task in SweMini.tasks(0):
        key = (task.reference["path"], task.reference["buggy"])
        if key not in seen:
            seen.add(key)
            yield task
        if len(seen) == 6:
            return


def test_swe_mini_expert_fixes_every_variant_through_the_tools():
    tasks = list(every_swe_variant())

    async def episode(pool: SandboxPool, task: Task) -> Episode:
        sandbox = await pool.create(SweMini.template.name, files=task.files)
        try:
            return await play(SweMini(task, sandbox), ScriptedFixer(task))
        finally:
            await sandbox.close()

    async def body(pool: SandboxPool) -> list[Episode]:
        return await asyncio.gather(*(episode(pool, task) for task in tasks))

    for task, (reward, steps) in zip(tasks, with_pool(SweMini, body), strict=True):
        first_run, last_run = steps[0].observation, steps[3].observation
        assert first_run is not None and "FAILED" in first_run, task.reference
        assert last_run is not None and "\nOK\n" in last_run, (task.reference, last_run)
        assert reward == 1.0, task.reference


class QuickSweMini(SweMini):
    tool_timeout_s = 1.0


def test_swe_mini_deleting_tests_earns_nothing_and_tool_failures_are_observations():
    task = next(SweMini.tasks(0))

    async def body(pool: SandboxPool) -> tuple[list[str], Episode]:
        sandbox = await pool.create(SweMini.template.name, files=task.files)
        try:
            env = QuickSweMini(task, sandbox)
            await env.reset()
            observations = []
            for action in (
                call("bash", command="sleep 10"),
                call("read_file", path="../etc/passwd"),
                call("read_file", path="missing.py"),
                call("bash", command="exit 3"),
            ):
                result = await env.step(action)
                assert not result.done and result.observation is not None
                observations.append(result.observation)
            return observations, await play(env, CheatByDeletingTests())
        finally:
            await sandbox.close()

    observations, (reward, steps) = with_pool(SweMini, body)
    assert "[timed out]" in observations[0]
    assert "error: read_file failed: SandboxError: path must stay inside" in observations[1]
    assert "error: read_file failed: SandboxError" in observations[2]
    assert "[exit code 3]" in observations[3]
    cheat = steps[0].observation
    assert cheat is not None and "Ran 0 tests" in cheat  # the cheat made `unittest` pass...
    assert reward == 0.0  # ...but the reward runs the original tests


def test_swe_mini_tests_that_cannot_be_restored_score_zero():
    task = next(SweMini.tasks(0))

    async def body(pool: SandboxPool) -> float:
        sandbox = await pool.create(SweMini.template.name, files=task.files)
        try:
            env = SweMini(task, sandbox)
            await env.step(call("bash", command="rm test_stats.py && mkdir test_stats.py"))
            return await env.reward()
        finally:
            await sandbox.close()

    assert with_pool(SweMini, body) == 0.0


def test_swe_mini_a_fix_that_prints_past_the_output_cap_still_scores() -> None:
    task = next(SweMini.tasks(0))
    path, buggy, correct = (task.reference[k] for k in ("path", "buggy", "correct"))

    async def body(pool: SandboxPool) -> tuple[float, str]:
        sandbox = await pool.create(SweMini.template.name, files=task.files)
        try:
            env = SweMini(task, sandbox)
            fixed = (await sandbox.read_file(path)).decode().replace(buggy, correct)
            await sandbox.write_file(path, (fixed + "\nprint('x' * 200_000)\n").encode())
            run = await env.step(call("bash", command="python -m unittest"))
            return await env.reward(), run.observation or ""
        finally:
            await sandbox.close()

    reward, observation = with_pool(SweMini, body)
    assert "[exit code 137]" in observation  # the tool's command stopped at the cap...
    assert reward == 1.0  # ...but the tests pass, and the reward reads only their status


def test_agent_workload_runs_its_drawn_turns_and_tool_latencies_whatever_the_model_writes() -> None:
    task = next(AgentWorkload.tasks(seed=3))
    assert next(AgentWorkload.tasks(seed=3)).reference == task.reference  # seeded
    draws = task.reference["members"]

    async def body(pool: SandboxPool) -> list[tuple[float, list[StepResult]]]:
        async def member() -> Episode:
            sandbox = await pool.create(AgentWorkload.template.name)
            try:
                return await play(AgentWorkload(task, sandbox), lambda obs: "no tool call at all")
            finally:
                await sandbox.close()

        return list(await asyncio.gather(member(), member()))

    episodes = with_pool(AgentWorkload, body)
    # The two members took the task's first two draws, in some order.
    expected = sorted((d["reward"], len(d["tool_s"])) for d in draws[:2])
    assert sorted((reward, len(steps)) for reward, steps in episodes) == expected
    for _, steps in episodes:
        assert all(s.tool_calls == 1 and s.tool_errors == 0 for s in steps)
        assert all("<tool_response>" in (s.observation or "") for s in steps[:-1])


def test_agent_workload_draws_the_whole_swe_long_tool_latency_tail_scaled_down() -> None:
    """Heavy calls and hangs, not only the body: they are the stragglers a synchronous batch
    waits on. WORKLOADS.md: 2.4-3.7 % of calls over 10 s, ~1 % over 60 s (here x 0.25)."""
    tasks = islice(AgentWorkload.tasks(seed=0), 200)
    calls = [s for t in tasks for d in t.reference["members"][:8] for s in d["tool_s"]]
    over_10s = sum(s > 10 * TIME_SCALE for s in calls) / len(calls)
    over_60s = sum(s > 60 * TIME_SCALE for s in calls) / len(calls)
    assert 0.02 < over_10s < 0.05 and 0.005 < over_60s < 0.02
    assert max(calls) < AgentWorkload.tool_timeout_s  # a hang runs its length, not the timeout
