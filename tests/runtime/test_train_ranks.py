"""`venusrl train` with its trainer as sharded ranks (`trainer.world_size=2`)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.runtime import SMALL
from venusrl.config import load_config
from venusrl.engine.model_dir import load_model
from venusrl.runtime.record import read_metrics
from venusrl.runtime.train import train
from venusrl.trainer.checkpoint import SHARDED, latest_checkpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.mark.slow  # ~40 s
def test_a_run_on_two_trainer_ranks_resumes_from_its_sharded_checkpoint_with_the_next_step(
    tmp_path: Path,
) -> None:
    """The ranks imitate the warm start's demonstrations, write the start policy, hold the KL
    reference, publish to the engine after every step and checkpoint; a resume goes on from the
    sharded checkpoint. (SMALL's steps mostly train no token: its groups score alike. That the
    ranks' update is the 1-rank update is tests/trainer/test_ranks.py's.)"""
    cfg = load_config(
        None, [*SMALL, "trainer.world_size=2", "run.steps=2", "run.checkpoint_every=1"]
    )
    metrics = asyncio.run(train(cfg, tmp_path))
    warm = json.loads((tmp_path / "warm_start.json").read_text())
    assert warm["nll_last"] < warm["nll_first"]
    load_model(tmp_path / "start-model")
    assert [(m["step"], m["weight_version"]) for m in metrics] == [(0, 1), (1, 2)]
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.name == "step-000001"
    assert (checkpoint / SHARDED / ".metadata").is_file()
    load_model(checkpoint)  # the consolidated model, as `venusrl serve` loads it
    longer = load_config(tmp_path / "config.yaml", ["run.steps=3"])
    asyncio.run(train(longer, tmp_path, resume=True))
    steps = [(m["step"], m["weight_version"]) for m in read_metrics(tmp_path)]
    assert steps == [(0, 1), (1, 2), (2, 3)]
