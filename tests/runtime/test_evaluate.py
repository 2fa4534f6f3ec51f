"""`venusrl eval`: a model, a checkpoint or a run played on held-out tasks, scored with pass@k."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from tests.runtime import SMALL
from venusrl import cli
from venusrl.config import load_config
from venusrl.envs.builtin.math_python import TASKS
from venusrl.model.directory import init_model_dir
from venusrl.model.tool_formats import tool_parser
from venusrl.runtime.evaluate import check_k, pass_at_k, resolve_model, summarize
from venusrl.runtime.train import train
from venusrl.types import Failure, FailureKind, Finish, Trajectory

ROOT = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.fixture(scope="module")
def tool_calling_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run whose start policy imitated its 16 demonstrations long enough (~6 s) to
    call `open_cell` several times an episode (the shared `warm_started_small`, one epoch,
    seldom calls a tool)."""
    run = tmp_path_factory.mktemp("tool-calling-run")
    overrides = ["run.steps=1", "run.warm_start_epochs=8", "run.warm_start_lr=1e-2"]
    asyncio.run(train(load_config(None, [*SMALL, *overrides]), run))
    return run


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_drawn_hold_a_pass() -> None:
    # Chen et al. 2021's estimator equals the exact share of k-subsets with a pass.
    for n in range(1, 7):
        for c in range(n + 1):
            passed = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(passed, k))
                share = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(share), (n, c, k)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the plain mean
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)


def episode(reward: float | None, tool_calls: int = 0) -> Trajectory:
    traj = Trajectory.start("t", "g", "p", [1, 2])
    traj.reward, traj.tool_calls, traj.finish = reward, tool_calls, Finish.DONE
    if reward is None:
        traj.finish, traj.failure = Finish.INFRA, Failure(FailureKind.SANDBOX, "sandbox died")
    return traj


def test_infrastructure_failures_count_as_failures_not_as_losses_of_the_policy() -> None:
    played = [
        *(episode(1.0, 3), episode(0.0, 1), episode(0.0, 2)),  # task 0: 1 win in 3
        *(episode(None), episode(0.0, 1), episode(0.0, 1)),  # task 1: a failure, 2 losses
    ]
    report = summarize(played, samples=3, k=2)
    assert report["pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert report["pass@2"] == pytest.approx((pass_at_k(3, 1, 2) + pass_at_k(2, 0, 2)) / 2)
    assert report["reward_mean"] == pytest.approx(1 / 5) and report["scored"] == 5
    assert report["tool_calls_per_episode"] == pytest.approx(8 / 5)
    assert report["tool_calls_per_win"] == 3
    assert report["failures"] == {"sandbox": 1} and report["failure_examples"] == ["sandbox died"]
    assert report["finish"] == {"done": 5, "infra": 1}
    # A task left with fewer scored samples than k says nothing of pass@k.
    assert summarize(played, samples=3, k=3)["tasks_scored"] == 1


def fake_checkpoint(run: Path, step: int, model: Path) -> Path:
    path = run / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    for f in model.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    (path / "state.json").write_text(json.dumps({"step": step, "weight_version": step + 1}))
    torch.save({}, path / "optimizer.pt")
    return path


def test_a_run_directory_resolves_to_its_newest_checkpoint_that_reads_back(
    tmp_path: Path,
) -> None:
    model = init_model_dir(tmp_path / "model", "micro")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run:\n  seed: 3\n")
    fake_checkpoint(run, 4, model)
    newest = fake_checkpoint(run, 9, model)
    (fake_checkpoint(run, 12, model) / "model.safetensors").write_bytes(b"torn")
    assert resolve_model(run) == (newest, run)
    # A checkpoint named directly plays itself, in its run (whose config it takes).
    older = run / "checkpoints" / "step-000004"
    assert resolve_model(older) == (older, run)
    assert resolve_model(model) == (model, None)


def test_bad_inputs_are_refused_saying_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match=r"not a model directory \(no config.json\)"):
        resolve_model(tmp_path)
    bare = init_model_dir(tmp_path / "bare", "micro", tokenizer=False)
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        resolve_model(bare)
    run = tmp_path / "run"
    (run / "start-model").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(ValueError, match=f"run directory {run} has no checkpoint"):
        resolve_model(run)
    with pytest.raises(ValueError, match="pass@4 needs at least 4 samples per task"):
        check_k(4, samples=2)
    with pytest.raises(ValueError, match="--k must be >= 1"):
        check_k(0, samples=2)


def test_an_unknown_environment_or_greedy_sampling_of_several_samples_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = init_model_dir(tmp_path / "model", "micro")
    assert cli.main(["eval", str(model), "--env", "nowhere_hunt"]) == 2
    assert "--env: 'nowhere_hunt' is neither a built-in environment" in capsys.readouterr().err
    assert cli.main(["eval", str(model), "--greedy", "--k", "2"]) == 2
    assert "temperature 0) plays a task the same way every time" in capsys.readouterr().err
    assert cli.main(["eval", str(model), "--k", "3", "--samples", "2"]) == 2
    assert "pass@3 needs at least 3 samples per task" in capsys.readouterr().err
    assert cli.main(["eval", str(model), "--field", "prompt=question"]) == 2
    assert "--field maps the fields of a --tasks file" in capsys.readouterr().err
    tasks = ["--tasks", str(TASKS), "--env", "math_python"]
    assert cli.main(["eval", str(model), *tasks, "--field", "answr=x"]) == 2
    assert "--field: 'answr' is no field of math_python's tasks" in capsys.readouterr().err
    assert cli.main(["eval", str(model), *tasks, "--env", "guess_number"]) == 2
    assert "--tasks: guess_number makes its tasks in code" in capsys.readouterr().err
    mixed = "rollout.mix=[{env: treasure_hunt}, {env: guess_number}]"
    assert cli.main(["eval", str(model), mixed]) == 2
    assert "mixes environments (treasure_hunt, guess_number): choose one with --env" in (
        capsys.readouterr().err
    )


@needs_root
def test_eval_prints_pass_at_k_and_writes_transcripts_holding_the_tool_calls(
    tool_calling_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "episodes.jsonl"
    model = tool_calling_run / "start-model"
    args = ["eval", str(model), "--episodes", "2", "--k", "2", "--samples", "3"]
    assert cli.main([*args, "--out", str(out)]) == 0, capsys.readouterr().err
    shown = capsys.readouterr().out
    assert f"{model} on treasure_hunt" in shown
    for figure in ("pass@1", "pass@2", "reward_mean", "tool_calls_per_episode", "finish"):
        assert figure in shown
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task_id"], r["sample"]) for r in records] == [
        (task, s) for task in ("hunt-104729-0", "hunt-104729-1") for s in range(3)
    ]
    assert sum(r["tool_calls"] for r in records) > 0
    for r in records:
        roles = [part["role"] for part in r["transcript"]]
        assert roles[:2] == ["prompt", "model"] and "open_cell" in r["transcript"][0]["text"]
        # The transcript holds the very calls the environment counted (malformed ones too),
        # each model turn as the model wrote it, and the tools' answers after them.
        turns = [p["text"] for p in r["transcript"] if p["role"] == "model"]
        assert sum(len(tool_parser("hermes").parse(t)) for t in turns) == r["tool_calls"], turns
        if r["tool_calls"]:
            assert any("<tool_response>" in p["text"] for p in r["transcript"][2:])

    # A run directory plays its newest checkpoint, on the run's environment and task stream.
    assert cli.main(["eval", str(tool_calling_run), "--episodes", "1", "--greedy", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(tool_calling_run / "checkpoints" / "step-000000")
    assert report["env"] == "treasure_hunt" and report["temperature"] == 0.0
    assert report["episodes"] == 1 and report["pass@1"] in (0.0, 1.0)


@needs_root
def test_eval_plays_the_tasks_of_a_file_in_its_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = init_model_dir(tmp_path / "model", "micro")
    file = tmp_path / "sums.jsonl"
    rows = [
        {"key": "b", "question": "What is 4 * 6?", "expression": "4 * 6", "answer": 24},
        {"key": "a", "question": "What is 2 + 3?", "expression": "2 + 3", "answer": 5},
    ]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "episodes.jsonl"
    env = f"{ROOT}/examples/custom_env/arithmetic.py:Arithmetic"
    args = ["eval", str(model), "--env", env, "--tasks", str(file), "--json", "--out", str(out)]
    fields = ["--field", "prompt=question", "--field", "id=key"]
    assert cli.main([*args, *fields, "rollout.max_tokens_per_turn=8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["env"] == "arithmetic" and report["task_file"] == str(file)
    assert report["tasks"] == 2 and report["episodes"] == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in records] == ["b", "a"]
    assert "What is 4 * 6?" in records[0]["transcript"][0]["text"]
