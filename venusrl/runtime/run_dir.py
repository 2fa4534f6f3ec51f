"""A run's directory: set up fresh, or put back to its last checkpoint on `--resume`; and the
start policy a fresh run writes there (`start-model/`), RL's starting point and KL reference.

    config.yaml  metrics.jsonl  trajectories.jsonl  checkpoints/step-NNNNNN/ and step-start/
    initial-model/ (a run without `model`)  start-model/ (after a warm start)  warm_start.json
    tensorboard/  wandb/  wandb-run-id (with `run.loggers`)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from venusrl.config import Config
from venusrl.runtime import record
from venusrl.trainer.api import Trainer
from venusrl.trainer.checkpoint import RunState, latest_checkpoint, load_run_state


@dataclass(frozen=True)
class RunStart:
    """Where a run (re)starts."""

    model_dir: Path  # the model to load (on a fresh run without `model`: still to be written)
    state: RunState  # step -1 and version 0 on a fresh run
    wall_s: float  # the run's time when the checkpoint was saved: a resumed run's times go on
    fresh: bool


def prepare_run_dir(
    cfg: Config, run_dir: Path, resume: bool, say: Callable[[str], None]
) -> RunStart:
    """A fresh run's directory, or a resumed one put back to its last checkpoint (the steps
    after it are redone, so their metrics and records go)."""
    metrics_file = run_dir / "metrics.jsonl"
    if resume:
        checkpoint = latest_checkpoint(
            run_dir, lambda path, why: say(f"--resume: passing over {path.name}: {why}")
        )
        if checkpoint is None:
            raise ValueError(
                f"--resume: {run_dir} has no checkpoint that reads back (the first is written "
                "when the warm start ends, or without one after run.checkpoint_every="
                f"{cfg.run.checkpoint_every} steps): start again with another --run-dir, or "
                "remove this one"
            )
        _refuse_changes_to_the_model(cfg, run_dir)
        if (run_dir / "warm_start.json").exists() and not has_weights(run_dir / "start-model"):
            raise ValueError(
                f"--resume: {run_dir / 'start-model'} is missing, and the run warm-started: the"
                " policy written there is its KL reference (the initial model would not be)"
            )
        state = load_run_state(checkpoint)
        if state.step + 1 >= cfg.run.steps:
            raise ValueError(
                f"--resume: {run_dir} has trained {state.step + 1} steps, run.steps is "
                f"{cfg.run.steps}: nothing to train (pass run.steps=N with N > {state.step + 1}"
                " to train longer)"
            )
        # Steps after the checkpoint are redone: drop their lines so none appears twice.
        kept = [m for m in record.read_metrics(run_dir) if m["step"] <= state.step]
        tmp = metrics_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
        tmp.replace(metrics_file)
        record.truncate_records(run_dir, state.step)
        # What it resumes with, overrides included: the next --resume starts from this.
        _write_config(cfg, run_dir)
        done = "the warm start" if state.step < 0 else f"step {state.step + 1}"
        say(f"resuming from {checkpoint.relative_to(run_dir)} (after {done})")
        return RunStart(checkpoint, state, kept[-1]["wall_s"] if kept else 0.0, fresh=False)
    if metrics_file.exists():
        raise ValueError(f"{run_dir} already holds a run: pass --resume, or another --run-dir")
    if cfg.model and not (Path(cfg.model) / "config.json").is_file():
        raise ValueError(f"model: {cfg.model} is not a model directory (it has no config.json)")
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_config(cfg, run_dir)
    model_dir = Path(cfg.model) if cfg.model else run_dir / "initial-model"
    return RunStart(model_dir, RunState(step=-1, weight_version=0), 0.0, fresh=True)


# Keys whose value the checkpoint has already fixed (its weights are of that model): a resume
# that changes them would silently go on with the old one.
FIXED_ON_RESUME = ("model", "run.preset")


def _refuse_changes_to_the_model(cfg: Config, run_dir: Path) -> None:
    ran = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    now = cfg.model_dump()
    for key in FIXED_ON_RESUME:
        *sections, name = key.split(".")
        before, after = ran, now
        for section in sections:
            before, after = before.get(section) or {}, after[section]
        if before.get(name) != after[name]:
            raise ValueError(
                f"--resume: {key} cannot change on resume (the run's checkpoints are of"
                f" {key}={before.get(name)!r}); start a new run to train {after[name]!r}"
            )


def _write_config(cfg: Config, run_dir: Path) -> None:
    path = run_dir / "config.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    tmp.replace(path)


def start_policy(cfg: Config, run_dir: Path) -> Path:
    """The model directory of the policy reinforcement learning starts from: the warm-started one
    a fresh run wrote (`start-model/`), else the model the run was given. The KL penalty's
    reference and the learning benchmark's baseline."""
    warm = run_dir / "start-model"
    if has_weights(warm):
        return warm
    return Path(cfg.model) if cfg.model else run_dir / "initial-model"


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").exists()


def write_start_policy(run_dir: Path, trainer: Trainer, model_dir: Path) -> None:
    tmp, final = run_dir / ".tmp-start-model", run_dir / "start-model"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.write_model_dir(tmp, model_dir)
    # One left by a run stopped before its first step, in this directory started again.
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
