"""Checkpoints written by a run, resumed or not, read back as whole model directories."""

from __future__ import annotations

from pathlib import Path

import torch

from venusrl.model.directory import init_model_dir, load_model
from venusrl.trainer.checkpoint import RunState, checkpoints, latest_checkpoint, save_checkpoint

torch.set_num_threads(1)


def test_a_resumed_run_keeps_writing_checkpoints_that_load(tmp_path: Path) -> None:
    start = init_model_dir(tmp_path / "initial-model", preset="tiny", seed=0)
    run = tmp_path / "run"
    model = load_model(start)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(run, model, optimizer, RunState(step=9, weight_version=10), start)
    # --resume: the model directory the run copies its config and tokenizer from is the
    # checkpoint it resumed from, which the checkpoints written after it push out of the last two.
    resumed_from = latest_checkpoint(run)
    assert resumed_from is not None
    for step in (19, 29, 39):
        save_checkpoint(run, model, optimizer, RunState(step, step + 1), resumed_from)
    newest = latest_checkpoint(run)
    assert newest is not None and newest.name == "step-000039"
    for name in ("config.json", "tokenizer.json"):
        assert (newest / name).is_file(), name
    load_model(newest)


def test_a_checkpoint_without_its_config_is_passed_over_by_name(tmp_path: Path) -> None:
    start = init_model_dir(tmp_path / "initial-model", preset="tiny", seed=0)
    run = tmp_path / "run"
    model = load_model(start)
    optimizer = torch.optim.AdamW(model.parameters())
    older = save_checkpoint(run, model, optimizer, RunState(0, 1), start)
    newer = save_checkpoint(run, model, optimizer, RunState(1, 2), start)
    (newer / "config.json").unlink()  # as the checkpoints of a resumed run were written
    skipped: list[tuple[Path, str]] = []
    assert latest_checkpoint(run, lambda path, why: skipped.append((path, why))) == older
    assert skipped[0][0] == newer and "config.json" in skipped[0][1]


def test_the_warm_starts_checkpoint_is_the_oldest_and_goes_first(tmp_path: Path) -> None:
    start = init_model_dir(tmp_path / "initial-model", preset="micro", seed=0)
    run = tmp_path / "run"
    model = load_model(start)
    optimizer = torch.optim.AdamW(model.parameters())
    warm = save_checkpoint(run, model, optimizer, RunState(step=-1, weight_version=0), start)
    assert warm.name == "step-start" and latest_checkpoint(run) == warm
    # By name "step-start" sorts after the digits: the order must be the steps'.
    save_checkpoint(run, model, optimizer, RunState(0, 1), start)
    assert [p.name for p in checkpoints(run)] == ["step-start", "step-000000"]
    newest = save_checkpoint(run, model, optimizer, RunState(1, 2), start)
    assert latest_checkpoint(run) == newest
    assert [p.name for p in checkpoints(run)] == ["step-000000", "step-000001"]
