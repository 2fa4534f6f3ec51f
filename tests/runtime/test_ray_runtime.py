"""`runtime.kind=ray`: the same run with its engines and sandbox pools as actors of a real Ray
cluster of two nodes (two raylets on this machine)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.runtime import SMALL
from venusrl.config import load_config
from venusrl.engine.model_dir import init_model_dir, load_model
from venusrl.engine.request import SamplingParams
from venusrl.envs.types import SandboxCrashed, TemplateSpec
from venusrl.runtime.cluster.engines import EngineFleet, EngineLost
from venusrl.runtime.cluster.ray_cluster import RayCluster, check_reachable
from venusrl.runtime.cluster.sandboxes import ClusterPool
from venusrl.runtime.record import read_records
from venusrl.runtime.train import train
from venusrl.trainer.trainer import GRPOTrainer, TrainerConfig
from venusrl.types import Finish

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

NAMESPACE = "venusrl-test"
ON_TWO_ENGINES = ["runtime.kind=ray", "runtime.engines=2", f"runtime.namespace={NAMESPACE}"]
RAY_RUN = [*SMALL, *ON_TWO_ENGINES]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    node = {"num_cpus": 1, "object_store_memory": 256 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class KillAfterFirstStep(threading.Thread):
    """Kill the named actor, as a crashed worker process would die (Ray restarts it), once the
    run in `run_dir` has finished its first step."""

    def __init__(self, run_dir: Path, actor: str) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.actor, self.killed = run_dir, actor, threading.Event()
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 600
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                ray.kill(ray.get_actor(self.actor, namespace=NAMESPACE), no_restart=False)
                self.killed.set()
                return
            time.sleep(0.05)


def run_killing(actor: str, run_dir: Path, steps: int = 10) -> tuple[list[dict], dict]:
    """A run in which `actor` is killed after the first step; it must complete every step.
    Its metrics and `cluster.json`."""
    cfg = load_config(None, [*RAY_RUN, f"run.steps={steps}"])
    killer = KillAfterFirstStep(run_dir, actor)
    metrics = asyncio.run(train(cfg, run_dir))
    killer.join()
    assert killer.killed.is_set()
    assert [m["step"] for m in metrics] == list(range(steps))
    return metrics, json.loads((run_dir / "cluster.json").read_text())


async def fails_soon(error: type[Exception], attempt: Callable[[], Awaitable[object]]) -> None:
    """`ray.kill` lands asynchronously: calls right after it may still reach the old actor."""
    with pytest.raises(error):
        for _ in range(100):
            await attempt()
            await asyncio.sleep(0.05)


def test_two_engines_and_two_pools_keep_each_trajectory_on_one_engine_and_each_group_on_one_node(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    cfg = load_config(None, [*RAY_RUN, "run.steps=3"])
    metrics = asyncio.run(train(cfg, tmp_path))
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert [m["weight_version"] for m in metrics] == [1, 2, 3]
    report = json.loads((tmp_path / "cluster.json").read_text())
    # One engine per node (each node has one CPU, each engine asks for one).
    assert len({e["node"] for e in report["engines"]}) == 2
    assert len(report["sandbox_nodes"]) == 2
    # Every trajectory was served by exactly one engine, and both engines served.
    trained = [r["trajectory_id"] for r in read_records(tmp_path)]
    assert len(trained) == 3 * 2 * 2
    assert report["trajectories_on_several_engines"] == []
    assert all(n > 0 for n in report["trajectories_per_engine"])
    assert sum(report["trajectories_per_engine"]) >= len(trained)
    # Each group's members were forked on one node, and groups went to both nodes.
    assert report["groups_on_several_nodes"] == 0
    assert all(n > 0 for n in report["groups_per_node"])
    assert sum(m["infra_failures"] for m in metrics) == 0
    # Each node's own pool made the sandboxes of the groups it took.
    assert all(pool["sandboxes_created"] > 0 for pool in report["pools"])


def test_engines_the_cluster_cannot_hold_are_refused_before_any_actor_starts(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    cfg = load_config(None, [*RAY_RUN, "runtime.engines=3"])
    with pytest.raises(ValueError, match=r"engine_cpus=1\.0 needs 3 CPUs; the cluster has 2"):
        asyncio.run(train(cfg, tmp_path))
    assert ray.util.list_named_actors() == []


def test_a_killed_engine_costs_its_trajectories_as_infrastructure_failures_and_the_run_completes(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    metrics, report = run_killing("engine-0", tmp_path)
    restarted, other = report["engines"]
    assert (restarted["restarts"], other["restarts"]) == (1, 0)
    # The trajectories engine 0 held were replaced, not scored.
    assert sum(m["infra_failures"] for m in metrics) >= 1
    assert report["trajectories_on_several_engines"] == []
    for r in read_records(tmp_path):
        assert (r["reward"] is None) == (r["finish"] == Finish.INFRA.value)
        # Every token is within the staleness bound, including any the restarted engine served
        # (its start-up weights would be version 0).
        trained_at = metrics[r["step"]]["weight_version"] - 1
        assert all(0 <= trained_at - int(v) <= 1 for v in r["versions"])


def test_a_restarted_engine_is_given_the_current_weights_and_serves_new_trajectories(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    # The fleet on its own, so that the test waits for Ray's restart however long it takes
    # on a loaded machine, instead of hoping a run of N steps outlasts it.
    cfg = load_config(None, RAY_RUN)
    model_dir = tmp_path / "model"
    init_model_dir(model_dir, preset=cfg.run.preset, seed=0)
    trainer = GRPOTrainer(load_model(model_dir, "cpu"), TrainerConfig(), version=3)
    two_tokens = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8]

    async def scenario() -> None:
        fleet = await EngineFleet(cfg, model_dir, version=0).start()
        try:
            await fleet.publish(trainer, tmp_path, model_dir)
            await fleet.generate(prompt, two_tokens, trajectory_id="held")
            held = fleet.router.engine_of("held")
            assert held is not None
            ray.kill(fleet.actors[held], no_restart=False)
            await fails_soon(
                EngineLost, lambda: fleet.generate(prompt, two_tokens, trajectory_id="held")
            )
            await fleet.end_trajectory("held")
            deadline = time.monotonic() + 300
            while held not in fleet.replicas.up:
                assert time.monotonic() < deadline, "the killed engine never came back"
                await asyncio.sleep(0.2)
            # Two trajectories at once go to the two engines, the restarted one included, and
            # both generate with the weights published before the kill.
            outs = [await fleet.generate(prompt, two_tokens, trajectory_id=t) for t in "ab"]
            assert {fleet.router.engine_of(t) for t in "ab"} == {0, 1}
            assert all(out.weight_versions == [3, 3] for out in outs)
            assert fleet.report()["engines"][held]["restarts"] == 1
        finally:
            await fleet.close()

    asyncio.run(scenario())


def sandbox_processes() -> set[int]:
    """Processes in a pid namespace other than ours: every sandbox has its own."""
    own = os.readlink("/proc/self/ns/pid")
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") != own:
                    found.add(int(name))
            except OSError:  # gone meanwhile
                pass
    return found


def sandboxes_left(before: set[int], timeout_s: float = 10.0) -> set[int]:
    """Sandbox processes not there `before`, once those being killed had time to exit (a
    killed process leaves /proc only when its parent has reaped it)."""
    deadline = time.monotonic() + timeout_s
    while (left := sandbox_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_killed_sandbox_pool_costs_its_groups_and_the_run_completes(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    before = sandbox_processes()
    _, report = run_killing("sandboxes-1", tmp_path)
    assert report["manager_restarts"] == [0, 1]
    assert report["groups_on_several_nodes"] == 0
    for r in read_records(tmp_path):
        assert (r["reward"] is None) == (r["finish"] == Finish.INFRA.value)
    # The killed pool's sandboxes were reaped (by its successor, or with the run); the rest
    # closed with the run.
    assert not sandboxes_left(before)


def test_a_restarted_sandbox_pool_prepares_its_templates_again_and_takes_new_groups(
    two_nodes: Cluster,
) -> None:
    # The pools on their own, so that the test waits for Ray's restart however long it takes.
    cfg = load_config(None, RAY_RUN)
    nodes = RayCluster(cfg.runtime).nodes()
    before = sandbox_processes()

    async def scenario() -> None:
        async with ClusterPool(cfg, nodes) as pool:
            await pool.prepare_template(TemplateSpec(name="t", setup="ANSWER = 42"))
            groups = [await pool.open_group("t") for _ in range(2)]
            doomed = next(g for g in groups if g.node == 1)
            member = await doomed.add()
            ray.kill(pool.managers[1], no_restart=False)
            await fails_soon(SandboxCrashed, lambda: member.run_python("print(1)", timeout_s=10))
            await doomed.close()
            deadline = time.monotonic() + 300
            while 1 not in pool.replicas.up:
                assert time.monotonic() < deadline, "the killed pool never came back"
                await asyncio.sleep(0.2)
            # Its successor reaped the dead pool's sandbox and has the template again.
            new = [await pool.open_group("t") for _ in range(2)]
            assert 1 in {g.node for g in new}
            for g in new:
                out = await (await g.add()).run_python("print(ANSWER)", timeout_s=10)
                assert out.stdout == b"42\n"
                await g.close()
            report = await pool.report()
            assert report["manager_restarts"] == [0, 1]
            assert report["groups_since_start"][1] == sum(g.node == 1 for g in new)
            for g in groups:
                await g.close()

    asyncio.run(scenario())
    assert not sandboxes_left(before)


@pytest.mark.slow
def test_the_full_size_cpu_example_runs_on_two_nodes_with_two_engines(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    """The built-in CPU example at full size (256 demonstrations, B=4 groups of K=8), 60 steps:
    the cluster carries the real workload, and the reward rises as the local runtime's does
    (`test_reinforcement_learning_raises_the_reward_of_the_warm_started_policy`)."""
    cfg = load_config(None, [*ON_TWO_ENGINES, "run.steps=60"])
    metrics = asyncio.run(train(cfg, tmp_path))
    assert [m["step"] for m in metrics] == list(range(60))
    assert all(m["groups"] == 4 and m["reward_mean"] is not None for m in metrics)
    assert sum(m["infra_failures"] + m["masked"] for m in metrics) == 0
    assert len(list(read_records(tmp_path))) == 60 * 4 * 8
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.15
    report = json.loads((tmp_path / "cluster.json").read_text())
    assert report["trajectories_on_several_engines"] == []
    assert report["groups_on_several_nodes"] == 0
    assert all(n > 0 for n in report["trajectories_per_engine"])
    assert all(n > 0 for n in report["groups_per_node"])


@pytest.mark.parametrize(
    ("address", "words"),
    [("127.0.0.1:1", "nothing answers at 127.0.0.1:1"), ("nonsense", "is not host:port")],
)
def test_a_cluster_address_nobody_answers_on_is_an_error_at_once(address: str, words: str) -> None:
    with pytest.raises(ValueError, match=f"runtime.address: .*{words}"):
        check_reachable(address)
