"""Where a run's metrics go (`run.loggers`): TensorBoard event files and an offline W&B run that
read back what metrics.jsonl holds, through a resume; and `venusrl show`'s transcripts."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from venusrl import cli
from venusrl.config import ConfigError, load_config
from venusrl.model.tokenizer import CHATML_TEMPLATE, Tokenizer, build_byte_level_tokenizer
from venusrl.runtime.loggers import JsonlLogger, RunLoggers, TensorBoardLogger, open_loggers
from venusrl.runtime.record import read_metrics, read_records
from venusrl.runtime.train import train
from venusrl.runtime.transcripts import transcript

root = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

# Each backend gets these of every step, under these names (and the engine's and pool's counters).
LOGGED = {
    "trainer/loss": "loss",
    "trainer/kl": "kl",
    "trainer/entropy": "entropy",
    "trainer/clip_fraction": "clip_fraction",
    "trainer/ratio_mean": "ratio_mean",
    "trainer/grad_norm": "grad_norm",
    "trainer/tokens": "tokens",
    "trainer/sampler_kl": "sampler_kl",
    "rollout/versions_per_trajectory_max": "versions_per_trajectory_max",
    "rollout/staleness_mean": "staleness_mean",
    "rollout/staleness_max": "staleness_max",
    "failures/infra_failures": "infra_failures",
    "failures/groups_dropped": "groups_dropped",
}


@pytest.fixture(scope="module")
def logged_run(
    tmp_path_factory: pytest.TempPathFactory, warm_started_small: list[str]
) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """Two steps logged to all three backends; then, as if the run had been killed before its
    second checkpoint, resumed from its first to a third step: step 1 is trained again.
    Yields the run directory and the first attempt's metrics."""
    run = tmp_path_factory.mktemp("logged")
    wandb_home = tmp_path_factory.mktemp("wandb-home")
    loggers = [
        "run.loggers=[jsonl,tensorboard,wandb]",
        "run.wandb_mode=offline",
        "run.checkpoint_every=1",
    ]
    with pytest.MonkeyPatch.context() as env:
        for key in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(key, str(wandb_home))
        env.setenv("WANDB_SILENT", "true")
        cfg = load_config(None, [*warm_started_small, *loggers, "run.steps=2"])
        first = asyncio.run(train(cfg, run))
        shutil.rmtree(run / "checkpoints" / "step-000001")
        more = load_config(run / "config.yaml", ["run.steps=3"])
        asyncio.run(train(more, run, resume=True))
        yield run, first


@root
def test_tensorboard_event_files_hold_every_steps_scalars_once_through_a_resume(
    logged_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = logged_run
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag, key in LOGGED.items():
        points = [(e.step, e.value) for e in events.Scalars(tag)]
        # Step 1, trained twice, shows once: the resumed run's (the killed run's is purged).
        assert points == [(m["step"], pytest.approx(m[key], rel=1e-5)) for m in metrics], tag
    assert {"engine/generated_tokens", "engine/busy_s", "pool/sandboxes_created"} <= tags
    last = events.Scalars("engine/generated_tokens")[-1].value
    assert last == metrics[-1]["engine"]["generated_tokens"] > 0
    assert any(m["reward_mean"] is not None for m in metrics)
    rewards = [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")]
    assert rewards == [(m["step"], pytest.approx(m["reward_mean"])) for m in metrics]


def wandb_history(run: Path) -> list[dict[str, Any]]:
    """The history rows of the run's offline W&B runs, read from their `.wandb` files (a
    LevelDB-style log of `Record` protobufs in 32 KiB blocks), oldest run first."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, chunks = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunks = (b"" if kind in (1, 2) else chunks) + data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or its last piece
                rec = pb.Record()
                rec.ParseFromString(chunks)
                if rec.WhichOneof("record_type") == "history":
                    items = rec.history.item
                    rows.append(
                        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                    )
    return rows


@root
def test_an_offline_wandb_run_holds_every_step_and_a_resume_continues_it(
    logged_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    run, first = logged_run
    metrics = read_metrics(run)
    run_id = (run / "wandb-run-id").read_text().strip()
    attempts = sorted((run / "wandb").glob("offline-run-*"))
    # offline-run-DATE_TIME-ID, and -1 after it when the resume starts within the same second.
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(attempts) == 2 and all(named.fullmatch(p.name) for p in attempts)
    rows = wandb_history(run)
    # The first attempt's two steps, then the resumed run's steps 1 and 2, over `step`.
    assert [r["step"] for r in rows] == [0, 1, 1, 2]
    expected = [*first, *metrics[1:]]
    for row, m in zip(rows, expected, strict=True):
        for tag, key in LOGGED.items():
            assert row[tag] == pytest.approx(m[key], rel=1e-6), tag
        assert row["engine/generated_tokens"] == m["engine"]["generated_tokens"]


@root
def test_show_prints_each_turn_of_a_real_trajectory_with_its_tool_calls_and_observations(
    logged_run: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = logged_run
    traj = max(read_records(run), key=lambda r: (r["tool_calls"], len(r["turns"])))
    assert traj["tool_calls"] > 0  # the warm-started policy calls the tool, if not always well
    capsys.readouterr()
    assert cli.main(["show", str(run), "--trajectory", traj["trajectory_id"]]) == 0
    out = capsys.readouterr().out
    assert traj["trajectory_id"] in out and f"step {traj['step']}" in out
    assert f"reward {traj['reward']:g}" in out and f"finish {traj['finish']}" in out
    # Every <tool_call> block the environment counted, well-formed or not, parsed from the
    # decoded model text; every observation, with the environment's <tool_response>.
    assert out.count("\ntool call") == traj["tool_calls"]
    answered = [t for t in traj["turns"] if t["observation_tokens"]]
    assert out.count("\nobservation  ") == len(answered) and "<tool_response>" in out
    trained_at = read_metrics(run)[traj["step"]]["weight_version"] - 1
    version = traj["turns"][0]["weight_versions"][-1]
    assert "turn 1  version " in out and f"staleness {trained_at - version}" in out
    # A step's batch, cut to --limit, says how many it left out.
    assert cli.main(["show", str(run), "--step", "0", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nturn 1 ") == 1 and "1 of 4 trajectories shown" in out
    assert cli.main(["show", str(run), "--step", "7"]) == 2
    assert "--step: " in capsys.readouterr().err


def test_a_transcript_shows_a_well_formed_tool_call_the_observation_and_the_staleness() -> None:
    byte_level = build_byte_level_tokenizer()
    tok = Tokenizer(byte_level, chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>")
    prompt = tok.encode("<|im_start|>user\nFind the treasure.<|im_end|>\n<|im_start|>assistant\n")
    call = '<tool_call>\n{"name": "open_cell", "arguments": {"cell": 31}}\n</tool_call>'
    action = tok.encode(call + "<|im_end|>")
    observation = tok.encode("\n<|im_start|>user\n<tool_response>\nclue: 17\n</tool_response>")
    answer = tok.encode("found\x05 it<|im_end|>")
    turns = [
        {"action_tokens": len(action), "observation_tokens": len(observation),
         "weight_versions": [2]},
        {"action_tokens": len(answer), "observation_tokens": 0, "weight_versions": [3]},
    ]  # fmt: skip
    r = {
        "trajectory_id": "g0-m1-0", "step": 4, "env": "treasure_hunt", "group_id": "g0",
        "prompt_id": "hunt-0-0", "reward": 1.0, "finish": "done", "failure": None,
        "failure_kind": None, "tool_calls": 1, "turns": turns,
        "turn_starts": [len(prompt), len(prompt) + len(action) + len(observation)],
        "token_ids": prompt + action + observation + answer,
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=200)
    console.print(transcript(r, tok, trained_at=3))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "reward 1  finish done  tool calls 1  trained at version 3" in out
    assert "prompt (" in out and "Find the treasure." in out
    assert "turn 1  version 2  staleness 1" in out and "turn 2  version 3  staleness 0" in out
    assert 'tool call  open_cell({"cell": 31})' in out
    assert "observation  \n<|im_start|>user\n<tool_response>\nclue: 17" in out
    assert "model  found\\x05 it<|im_end|>" in out  # a control character, escaped


def test_an_unknown_logger_or_one_without_the_record_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"run\.loggers\.1: Input should be 'jsonl'"):
        load_config(None, ["run.loggers=[jsonl,mlflow]"])
    with pytest.raises(ConfigError, match=r"run\.loggers: .*must keep jsonl"):
        load_config(None, ["run.loggers=[tensorboard]"])
    assert load_config(None).run.loggers == ["jsonl"]


@pytest.mark.parametrize(("logger", "module"), [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_logger_whose_package_is_missing_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logger: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    cfg = load_config(None, [f"run.loggers=[jsonl,{logger}]"])
    with pytest.raises(ValueError, match=rf"run\.loggers: {logger} needs .* pip install {module}"):
        open_loggers(cfg, tmp_path, 0, pytest.fail)


class Failing:
    def __init__(self) -> None:
        self.closed = False

    def log(self, line: dict[str, Any]) -> None:
        if line["step"] == 1:
            raise OSError(28, "No space left on device")

    def close(self, failed: bool) -> None:
        self.closed = failed


def test_a_logger_failing_mid_run_is_dropped_and_metrics_jsonl_keeps_every_step(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    failing = Failing()
    loggers = RunLoggers({"jsonl": JsonlLogger(tmp_path), "tensorboard": failing}, said.append)
    for step in range(3):
        loggers.log({"step": step, "loss": 0.5})
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2]
    assert len(said) == 1 and "tensorboard logger failed at step 1" in said[0]
    assert "No space left on device" in said[0] and failing.closed
    assert list(loggers.loggers) == ["jsonl"]


@root
def test_a_logger_failing_mid_run_costs_no_step_metrics_line_or_checkpoint(
    tmp_path: Path, warm_started_small: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(self: TensorBoardLogger, line: dict[str, Any]) -> None:
        if line["step"] == 1:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorBoardLogger, "log", disk_full)
    loggers = ["run.loggers=[jsonl,tensorboard]", "run.checkpoint_every=1"]
    said: list[str] = []
    cfg = load_config(None, [*warm_started_small, *loggers])
    metrics = asyncio.run(train(cfg, tmp_path, on_message=said.append))
    assert [m["step"] for m in read_metrics(tmp_path)] == [m["step"] for m in metrics] == [0, 1, 2]
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-000001", "step-000002"]  # the last two, the failing step's too
    assert [m for m in said if "logger failed" in m] == [
        "warning: the tensorboard logger failed at step 1 (OSError: [Errno 28] No space left on"
        " device); the run goes on without it (metrics.jsonl has every step)"
    ]
