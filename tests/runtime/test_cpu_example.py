"""The CPU example end to end, as a user runs it: `venusrl train` of
examples/cpu-treasure-hunt.yaml on the tasks of a jsonl file, its metrics read back from
TensorBoard's event files and an offline W&B run, and `venusrl eval` of its last checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.runtime import SMALL
from tests.runtime.test_loggers import LOGGED, wandb_history
from venusrl import cli
from venusrl.envs.builtin.treasure_hunt import TASK_FILE
from venusrl.runtime.record import read_metrics, read_records

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cpu-treasure-hunt.yaml"
root = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@root
def test_the_cpu_example_trains_from_a_task_file_into_tensorboard_and_wandb_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # run.wandb_mode left to its default: the env's
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    keys = [
        f"rollout.tasks={TASK_FILE}",
        "run.loggers=[jsonl,tensorboard,wandb]",
        "run.steps=2",
        # Its own warm start, on the file's tasks, imitated long enough (~6 s) to call open_cell.
        "run.warm_start_epochs=8",
        "run.warm_start_lr=1e-2",
    ]
    train = ["train", "--config", str(EXAMPLE), "--run-dir", str(run)]
    assert cli.main([*train, *SMALL, *keys]) == 0, capsys.readouterr().err[-3000:]
    # What the main job prints at its end: where each result went and how to look at it.
    said = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "step 2/2 reward " in said
    for where in (
        f"metrics in {run / 'metrics.jsonl'}",
        f"tensorboard --logdir {run / 'tensorboard'}",
        f"venusrl show {run}",
        f"wandb sync {run / 'wandb'}/offline-run-*",
        f"venusrl eval {run} --k 4",
    ):
        assert where in said, where

    # The demonstrator wins only by following the trail the row's setup hid in the sandbox (at
    # its slip rate about half of its episodes: none in 16 would take a broken setup).
    warm = json.loads((run / "warm_start.json").read_text())
    assert warm["episodes"] == 16 and warm["demo_reward_mean"] > 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [0, 1]
    assert sum(m["infra_failures"] for m in metrics) == 0
    # Every group played a task of the file (its ids, then the epoch), none of tasks(seed)'s.
    file_ids = {json.loads(line)["id"] for line in TASK_FILE.read_text().splitlines()}
    played = {r["prompt_id"].partition("@")[0] for r in read_records(run)}
    assert played and played <= file_ids

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag, key in {**LOGGED, "rollout/reward_mean": "reward_mean"}.items():
        points = [(e.step, e.value) for e in events.Scalars(tag)]
        assert points == [(m["step"], pytest.approx(m[key], rel=1e-5)) for m in metrics], tag
    for counter in ("generated_tokens", "busy_s"):
        points = [(e.step, e.value) for e in events.Scalars(f"engine/{counter}")]
        expected = [(m["step"], pytest.approx(m["engine"][counter], rel=1e-5)) for m in metrics]
        assert points == expected, counter
        assert points[-1][1] > 0, counter
    created = [e.value for e in events.Scalars("pool/sandboxes_created")]
    assert created == [m["pool"]["sandboxes_created"] for m in metrics] and created[-1] > 0

    [offline] = (run / "wandb").glob("offline-run-*")
    assert offline.name.endswith((run / "wandb-run-id").read_text().strip())
    rows = wandb_history(run)
    assert [r["step"] for r in rows] == [0, 1]
    for row, m in zip(rows, metrics, strict=True):
        for tag, key in LOGGED.items():
            assert row[tag] == pytest.approx(m[key], rel=1e-6), tag
        assert row["engine/generated_tokens"] == m["engine"]["generated_tokens"]

    # The run's last checkpoint, played on the first tasks of the run's own file.
    last = run / "checkpoints" / "step-000001"
    assert cli.main(["eval", str(run), "--k", "2", "--episodes", "2"]) == 0
    shown = capsys.readouterr().out
    assert f"{last} on treasure_hunt" in " ".join(shown.split())
    for figure in ("pass@1", "pass@2", "reward_mean", "task_file", "tool_calls_per_episode"):
        assert figure in shown, figure
    out = tmp_path / "episodes.jsonl"
    eval_json = ["eval", str(run), "--k", "2", "--episodes", "2", "--json", "--out", str(out)]
    assert cli.main(eval_json) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(last) and report["task_file"] == str(TASK_FILE)
    assert report["tasks"] == 2 and report["samples_per_task"] == 2 and report["episodes"] == 4
    assert 0 <= report["pass@1"] <= report["pass@2"] <= 1
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    first_two = [json.loads(line)["id"] for line in TASK_FILE.read_text().splitlines()[:2]]
    assert [e["task_id"] for e in episodes] == [t for t in first_two for _ in range(2)]
    wins = sum(e["reward"] > 0 for e in episodes)
    assert report["pass@1"] == pytest.approx(wins / 4)


def test_a_bad_row_of_a_treasure_hunt_task_file_stops_train_naming_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = TASK_FILE.read_text().splitlines()[:2]
    bad = json.loads(rows[1]) | {"trail": [24, 12, 36, 42, 24]}
    file = tmp_path / "hunts.jsonl"
    file.write_text(f"{rows[0]}\n{json.dumps(bad)}\n")
    train = ["train", "--config", str(EXAMPLE), "--run-dir", str(tmp_path / "run")]
    assert cli.main([*train, f"rollout.tasks={file}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{file}:2: the trail holds cell 24 twice; its cells must be distinct" in err
