"""`venusrl train` with its trainer as sharded ranks (`trainer.world_size=2`)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest

from tests.runtime import SMALL
from venusrl.config import load_config
from venusrl.model.directory import load_model
from venusrl.runtime.record import read_metrics
from venusrl.runtime.train import train
from venusrl.trainer.checkpoint import SHARDED, latest_checkpoint
from venusrl.trainer.ranks import RankFailed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.mark.slow  # ~60 s
def test_a_run_on_two_trainer_ranks_stops_when_one_dies_and_resumes_with_the_next_step(
    tmp_path: Path,
) -> None:
    """The ranks imitate the warm start's demonstrations, write the start policy, hold the KL
    reference, publish to the engine after every step and checkpoint. A rank killed after step
    1 stops the run, naming it; a resume goes on from the sharded checkpoint with step 2. (SMALL's
    steps mostly train no token: its groups score alike. That the ranks' update is the 1-rank
    update is tests/trainer/test_ranks.py's.)"""
    cfg = load_config(None, [*SMALL, "trainer.world_size=2", "run.checkpoint_every=1"])

    def kill_rank_1(line: dict[str, object]) -> None:
        if line["step"] == 1:
            (rank,) = [p for p in mp.active_children() if p.name == "venusrl-trainer-rank1"]
            os.kill(rank.pid, signal.SIGKILL)

    with pytest.raises(RankFailed, match=r"trainer rank 1 \(pid \d+\) died \(killed by signal 9\)"):
        asyncio.run(train(cfg, tmp_path, on_step=kill_rank_1))
    warm = json.loads((tmp_path / "warm_start.json").read_text())
    assert warm["nll_last"] < warm["nll_first"]
    load_model(tmp_path / "start-model")
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.name == "step-000001"
    assert (checkpoint / SHARDED / ".metadata").is_file()
    load_model(checkpoint)  # the consolidated model, as `venusrl serve` loads it
    asyncio.run(train(load_config(tmp_path / "config.yaml"), tmp_path, resume=True))
    steps = [(m["step"], m["weight_version"]) for m in read_metrics(tmp_path)]
    assert steps == [(0, 1), (1, 2), (2, 3)]
