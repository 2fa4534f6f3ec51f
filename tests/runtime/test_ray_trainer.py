"""`runtime.kind=ray` with `trainer.world_size=2`: the trainer ranks as Ray actors in one placement
group of a real two-node Ray cluster, torch.distributed (gloo) meeting at rank 0's node."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from tests.runtime import NAMESPACE, SMALL
from tests.trainer.test_ranks import assert_same_weights, batch, config
from venusrl.config import load_config
from venusrl.model.directory import init_model_dir, load_model
from venusrl.runtime.cluster.trainer_actors import RayRanks
from venusrl.runtime.config import RuntimeConfig
from venusrl.runtime.record import read_metrics
from venusrl.runtime.roles import start_fleet
from venusrl.runtime.train import train
from venusrl.trainer.checkpoint import SHARDED, latest_checkpoint
from venusrl.trainer.ranks import RankedTrainer, RankFailed
from venusrl.trainer.trainer import GRPOTrainer

ON_RAY = ["runtime.kind=ray", f"runtime.namespace={NAMESPACE}"]


def on_ray(**overrides: object) -> functools.partial[RayRanks]:
    return functools.partial(RayRanks, RuntimeConfig(kind="ray", namespace=NAMESPACE, **overrides))


def test_two_trainer_actors_step_as_one_local_process(two_nodes: Cluster, tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "micro", preset="micro", seed=0)
    trajectories, advantages = batch(1)
    cfg = config(world_size=2, kl_coef=0.1)
    one = GRPOTrainer(load_model(model_dir), cfg)
    expected = [one.step(trajectories, advantages), one.step(*batch(2))]
    # One CPU a rank, one CPU a node: the placement group spreads them over both nodes.
    ranks = RankedTrainer(model_dir, cfg, launch=on_ray(trainer_cpus=1.0))
    try:
        got = [ranks.step(trajectories, advantages), ranks.step(*batch(2))]
        weights = dict(ranks.hf_weights())
        (group,) = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    finally:
        ranks.close()
    assert len(set(group["bundles_to_node_id"].values())) == 2  # gloo met across nodes
    for e, g in zip(expected, got, strict=True):
        assert (g.version, g.tokens, g.trajectories) == (e.version, e.tokens, e.trajectories)
        for field in ("loss", "grad_norm", "clip_fraction", "mean_ratio", "entropy", "kl"):
            want = pytest.approx(getattr(e, field), rel=1e-5, abs=1e-5)
            assert getattr(g, field) == want, field
    assert expected[0].grad_norm > cfg.max_grad_norm and expected[1].kl > 0
    assert_same_weights(weights, one.model.hf_state_dict())
    assert ray.util.list_named_actors() == []  # closed, placement group and all
    assert placement_group_table()[group["placement_group_id"]]["state"] == "REMOVED"


def test_trainer_ranks_the_cluster_cannot_hold_beside_the_engines_are_refused_at_once(
    two_nodes: Cluster,
) -> None:
    cfg = load_config(None, [*ON_RAY, "runtime.engines=1", "trainer.world_size=2"])

    async def start() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(start_fleet(cfg, stack))

    words = r"runtime.engines=1 x runtime.engine_cpus=1.0 \+ trainer.world_size=2 x 1 needs 3 CPUs"
    with pytest.raises(ValueError, match=rf"{words}; the cluster has 2"):
        asyncio.run(start())
    assert ray.util.list_named_actors() == []


def test_a_killed_trainer_actor_stops_the_step_with_an_error_naming_it(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    model_dir = init_model_dir(tmp_path / "micro", preset="micro", seed=0)
    ranks = RankedTrainer(model_dir, config(world_size=2), launch=on_ray(trainer_cpus=1.0))
    ray.kill(ray.get_actor("trainer-rank-1", namespace=NAMESPACE))
    # Rank 0 would wait in the step's first collective for trainer.rank_timeout_s (30 min).
    named = r"trainer rank 1 \(Ray actor trainer-rank-1, pid \d+ on [\d.]+\) died during 'step'"
    with pytest.raises(
        RankFailed, match=rf"{named}; the other ranks are stopped\n(.|\n)*ray\.kill"
    ):
        ranks.step(*batch(4))
    ranks.close()
    assert ray.util.list_named_actors() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")
@pytest.mark.slow  # 35 s alone on 2 shared cores: a warm start, a run and its resume
def test_a_ray_run_on_two_trainer_actors_stops_naming_a_killed_one_and_resumes(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    """One rollout worker and two trainer actors (half a CPU each: the two nodes' two CPUs hold
    them all). The actors imitate the warm start's demonstrations, hold the KL reference, train
    every step, publish to the rollout worker after it and checkpoint; trainer-rank-1 killed
    after step 1 stops the run, naming it; `--resume` goes on from the sharded checkpoint with
    step 2."""
    trainer = ["trainer.world_size=2", "runtime.trainer_cpus=0.5", "run.checkpoint_every=1"]
    # Half its replies win: every step has groups whose rewards differ, so each trains tokens.
    parity = ["rollout.env=tests.runtime.reply_parity:ReplyParity", "rollout.group_size=4"]
    cfg = load_config(None, [*SMALL, *parity, *ON_RAY, "runtime.engines=1", *trainer])

    def kill_rank_1(line: dict[str, object]) -> None:
        if line["step"] == 1:
            ray.kill(ray.get_actor("trainer-rank-1", namespace=NAMESPACE))

    named = r"trainer rank 1 \(Ray actor trainer-rank-1, pid \d+ on [\d.]+\) died"
    with pytest.raises(RankFailed, match=named):
        asyncio.run(train(cfg, tmp_path, on_step=kill_rank_1))
    warm = json.loads((tmp_path / "warm_start.json").read_text())
    assert warm["nll_last"] < warm["nll_first"]  # the actors imitated the demonstrations
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.name == "step-000001"
    assert (checkpoint / SHARDED / ".metadata").is_file()
    # Rank 0's consolidated model, as `venusrl serve` loads it: trained since the start policy.
    start, trained = (load_model(d).hf_state_dict() for d in (tmp_path / "start-model", checkpoint))
    assert any(not torch.equal(start[name], trained[name]) for name in start)
    asyncio.run(train(load_config(tmp_path / "config.yaml"), tmp_path, resume=True))
    metrics = read_metrics(tmp_path)
    assert [(m["step"], m["weight_version"]) for m in metrics] == [(0, 1), (1, 2), (2, 3)]
    assert all(m["tokens"] > 0 and m["grad_norm"] > 0 for m in metrics)
    assert metrics[-1]["kl"] > 0  # the actors hold the KL reference, the resumed ones too
    # The trainer actors are gone with the run (the rollout worker goes in the background).
    assert not [a for a in ray.util.list_named_actors() if a.startswith("trainer-rank")]
