"""Everything in examples/ works as the code stands: examples must not rot."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from tests.envs.test_builtin_envs import call, play, with_pool
from venusrl.config import load_config
from venusrl.envs.loading import environment_class
from venusrl.envs.service import SandboxSource

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_there_are_example_configs() -> None:
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # as the README runs them: their paths are the repository's
    cfg = load_config(path)
    assert cfg.run.steps >= 1


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")
def test_the_custom_environment_example_scores_its_demonstrator_and_refuses_bad_input() -> None:
    env = environment_class(f"{ROOT}/examples/custom_env/arithmetic.py:Arithmetic")
    tasks = list(itertools.islice(env.tasks(0), 60))
    assert len({t.id for t in tasks}) == 60  # the 48-line file twice, ids still unique

    async def body(pool: SandboxSource) -> list[tuple[float, list[str]]]:
        async def episode(policy_turns: list[str] | None) -> tuple[float, list[str]]:
            task = tasks[0]
            sandbox = await pool.create(env.template.name, setup=task.setup, files=task.files)
            try:
                demonstrator = env.demonstrator(task, 0)
                turns = iter(policy_turns or [])
                policy = demonstrator if policy_turns is None else (lambda _: next(turns))
                reward, steps = await play(env(task, sandbox), policy)
                return reward, [s.observation or "" for s in steps]
            finally:
                await sandbox.close()

        wrong = call("submit", answer=tasks[0].reference["answer"] + 1)
        hostile = call("calculate", expression="__import__('os').system('id')")
        power = call("calculate", expression="9**9**9")
        return [await episode(None), await episode([wrong]), await episode([hostile, power, wrong])]

    demonstrated, wrong, hostile = with_pool(env, body)
    assert demonstrated[0] == 1.0 and len(demonstrated[1]) == 2
    assert wrong == (0.0, [""])  # submitting ends the episode, scored against the reference
    assert "only numbers, + - * / and parentheses are allowed" in hostile[1][0]
    assert "only numbers" in hostile[1][1] and hostile[0] == 0.0
