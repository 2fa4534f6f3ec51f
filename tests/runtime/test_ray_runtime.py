"""`runtime.kind=ray`: the same run with its rollout workers (an engine, a sandbox pool and the
agent loops each) as actors of a real Ray cluster of two nodes (two raylets on this machine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from tests.processes import left_after, pool_processes
from tests.runtime import NAMESPACE, SMALL
from venusrl.config import Config, load_config
from venusrl.envs.builtin.agent_workload import AgentWorkload
from venusrl.envs.builtin.treasure_hunt import TreasureHunt
from venusrl.envs.environment import Environment, Task
from venusrl.model.directory import init_model_dir, load_model
from venusrl.model.weight_stream import WeightStream
from venusrl.runtime.cluster.fleet import RemoteGroup, RolloutFleet
from venusrl.runtime.cluster.ray_cluster import RayCluster, check_reachable
from venusrl.runtime.record import read_records
from venusrl.runtime.roles import start_fleet
from venusrl.runtime.train import train
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import Finish, Progress, SamplingParams, Trajectory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

ON_TWO_ENGINES = ["runtime.kind=ray", "runtime.engines=2", f"runtime.namespace={NAMESPACE}"]
RAY_RUN = [*SMALL, *ON_TWO_ENGINES]


def playing(report: dict[str, Any]) -> bool:
    """A rollout worker's report: several episodes at once, one still running when a kill lands."""
    return report["episodes_in_flight"] >= 2


class KillAfterFirstStep(threading.Thread):
    """Kill the named actor, as a crashed process would die (Ray restarts it), once the run in
    `run_dir` has finished its first step and the actor's report says it is `busy` (a rollout
    worker playing episodes, by default)."""

    def __init__(
        self, run_dir: Path, actor: str, busy: Callable[[dict[str, Any]], bool] = playing
    ) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.actor, self.busy = run_dir, actor, busy
        self.killed = threading.Event()
        self.pid = 0  # the killed process's
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 600
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                worker = ray.get_actor(self.actor, namespace=NAMESPACE)
                report = ray.get(worker.report.remote())
                if self.busy(report):
                    self.pid = report["pid"]
                    ray.kill(worker, no_restart=False)
                    self.killed.set()
                    return
            time.sleep(0.01)


def run_killing(
    actor: str, run_dir: Path, warm_started_small: list[str], steps: int = 10
) -> tuple[list[dict], dict, int]:
    """A run from SMALL's warm-started policy in which `actor` is killed after the first step;
    it must complete every step. Its metrics, `cluster.json` and the killed process's pid."""
    cfg = load_config(None, [*warm_started_small, *ON_TWO_ENGINES, f"run.steps={steps}"])
    killer = KillAfterFirstStep(run_dir, actor)
    metrics = asyncio.run(train(cfg, run_dir))
    killer.join()
    assert killer.killed.is_set()
    assert [m["step"] for m in metrics] == list(range(steps))
    return metrics, json.loads((run_dir / "cluster.json").read_text()), killer.pid


def test_two_workers_keep_each_trajectory_on_one_engine_and_each_group_on_one_node(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    cfg = load_config(None, [*RAY_RUN, "run.steps=3"])
    metrics = asyncio.run(train(cfg, tmp_path))
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert [m["weight_version"] for m in metrics] == [1, 2, 3]
    report = json.loads((tmp_path / "cluster.json").read_text())
    workers = report["workers"]
    # One worker per node (each node has one CPU, each engine asks for one).
    assert len({w["node"] for w in workers}) == 2
    records = list(read_records(tmp_path))
    trained = [r["trajectory_id"] for r in records]
    assert len(trained) == 3 * 2 * 2
    # The step metrics carry the engines' counters: every token trained was generated.
    actions = sum(t["action_tokens"] for r in records for t in r["turns"])
    assert metrics[-1]["engine"]["generated_tokens"] >= actions > 0
    # Each worker's engine ran its own KV window (rollout.admission=critical, the default):
    # every turn trained was let run by one.
    turns = sum(len(r["turns"]) for r in records)
    assert metrics[-1]["engine"]["window_turns"] >= turns > 0
    # Every trained member's tool calls reached the driver's ranking (with its trajectory,
    # if not before: reports while it ran are relayed only beside another episode's end).
    acted = sum("acted" in t for r in records for t in r["turns"])
    assert metrics[-1]["tool_calls_seen"] >= acted > 0
    # No trajectory id reached two engines, and both workers played episodes of groups
    # placed on them, each group's sandboxes made by that worker's own pool.
    assert report["trajectories_on_several_engines"] == []
    assert all(w["episodes_played"] > 0 and w["groups_placed"] > 0 for w in workers)
    assert sum(w["episodes_played"] for w in workers) >= len(trained)
    assert sum(w["trajectories_served"] for w in workers) >= len(trained)
    assert all(w["pool"]["sandboxes_created"] > 0 for w in workers)
    # The step metrics carry the workers' pools as one (the report, written at the end, may
    # count sandboxes of groups that ran ahead of the last step).
    created = metrics[-1]["pool"]["sandboxes_created"]
    assert max(w["pool"]["sandboxes_created"] for w in workers) < created
    assert created <= sum(w["pool"]["sandboxes_created"] for w in workers)
    assert sum(m["infra_failures"] for m in metrics) == 0
    # One actor call per episode: turns and tool calls never cross a process boundary.
    # (Episodes still in flight when the run ended were cancelled: at most the groups the
    # staleness bound lets run ahead, 2 x B=2 groups of K=2.)
    calls, played = report["actor_calls"], sum(w["episodes_played"] for w in workers)
    assert played <= calls["play"] <= played + 2 * 2 * 2
    sandbox_calls = sum(calls.get(v, 0) for v in ("exec", "run_python", "read_file", "write_file"))
    assert "generate" not in calls and sandbox_calls > 0  # only the warm start's sandboxes
    assert sandbox_calls < 16 * 16  # 16 demonstrations of at most 8 turns, a call or two each


def test_an_environment_in_a_file_outside_any_package_runs_on_the_workers(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    # Off the workers' sys.path: each loads the file by its path, as the driver did.
    own = tmp_path / "elsewhere" / "own_guess.py"
    own.parent.mkdir()
    own.write_text(
        "from venusrl.envs.builtin.guess_number import GuessNumber\n\n\n"
        "class OwnGuess(GuessNumber):\n    name = 'own_guess'\n"
    )
    cfg = load_config(None, [*RAY_RUN, "run.steps=2", f"rollout.env={own}:OwnGuess"])
    metrics = asyncio.run(train(cfg, tmp_path / "run"))
    assert [m["step"] for m in metrics] == [0, 1]
    assert sum(m["infra_failures"] for m in metrics) == 0
    records = list(read_records(tmp_path / "run"))
    assert len(records) == 2 * 2 * 2 and {r["env"] for r in records} == {"own_guess"}
    workers = json.loads((tmp_path / "run" / "cluster.json").read_text())["workers"]
    assert sum(w["episodes_played"] for w in workers) >= len(records)


GRADED = """
from venusrl.envs.builtin.guess_number import GuessNumber


class GradedGuess(GuessNumber):
    \"\"\"guess_number graded from its output alone, in a fresh sandbox, as swe is.\"\"\"

    name = "graded_guess"
    reward_reads_sandbox = False

    async def output(self):
        r = await self.sandbox.run_python("print(solved)", timeout_s=self.tool_timeout_s)
        return r.stdout.decode().strip()

    @classmethod
    async def grade(cls, task, output, open_sandbox):
        grader = await open_sandbox()  # the grading's own sandbox, in a clean start state
        try:
            r = await grader.run_python("print(solved)", timeout_s=30)
        finally:
            await grader.close()
        assert r.stdout.strip() == b"False", r.text()
        return 1.0 if output == "True" else 0.0
"""


def test_rewards_are_graded_by_a_reward_worker_on_a_node_of_its_own(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    # A CPU-only node declaring the reward resource: the reward worker goes there, apart from
    # the rollout workers, and grades every trajectory in fresh sandboxes of its own pool.
    node = two_nodes.add_node(num_cpus=0, resources={"reward": 1})
    try:
        env = tmp_path / "graded_guess.py"
        env.write_text(GRADED)
        cfg = load_config(None, [*RAY_RUN, "run.steps=2", f"rollout.env={env}:GradedGuess",
                                 "reward.ray_resource=reward", "reward.workers=2",
                                 "run.warm_start_episodes=0"])  # fmt: skip
        metrics = asyncio.run(train(cfg, tmp_path / "run"))
    finally:
        two_nodes.remove_node(node)
    assert [m["step"] for m in metrics] == [0, 1]
    assert sum(m["infra_failures"] for m in metrics) == 0
    records = list(read_records(tmp_path / "run"))
    assert len(records) == 2 * 2 * 2 and all(r["reward"] in (0.0, 1.0) for r in records)
    report = json.loads((tmp_path / "run" / "cluster.json").read_text())
    rewards = report["reward_worker"]
    assert rewards["node"] == node.node_id
    assert rewards["node"] not in {w["node"] for w in report["workers"]}
    assert rewards["rewards_scored"] >= len(records) and rewards["rewards_failed"] == 0
    assert rewards["sandboxes_created"] == rewards["rewards_scored"]  # one grader's each
    assert metrics[-1]["rewards_scored"] >= 2 * 2 * 2  # the step line reads the actor's


def grading(report: dict[str, Any]) -> bool:
    """The reward worker's report: a scoring in flight."""
    return report["reward_workers_busy"] >= 1


@pytest.mark.slow  # the default suite's time: run by scripts/test.sh --slow
def test_a_killed_reward_worker_loses_no_trajectory_its_scorings_are_sent_again(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    env = tmp_path / "graded_guess.py"
    env.write_text(GRADED.replace("grader = await open_sandbox()", "await asyncio.sleep(1)\n"
                                  "        grader = await open_sandbox()")
                   .replace("from venusrl", "import asyncio\nfrom venusrl", 1))  # fmt: skip
    cfg = load_config(None, [*RAY_RUN, "run.steps=4", f"rollout.env={env}:GradedGuess",
                             "run.warm_start_episodes=0", "reward.retries=2"])  # fmt: skip
    killer = KillAfterFirstStep(tmp_path / "run", "rewards", grading)
    metrics = asyncio.run(train(cfg, tmp_path / "run"))
    killer.join()
    assert killer.killed.is_set()
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    records = list(read_records(tmp_path / "run"))
    # Every trajectory trained was scored (sent again after the kill), none scored 0 for it.
    assert all(r["reward"] in (0.0, 1.0) for r in records if r["finish"] != "infra")
    assert sum(m["infra_failures"] for m in metrics) == 0
    workers = json.loads((tmp_path / "run" / "cluster.json").read_text())["workers"]
    assert sum(w["rewards"]["rewards_lost"] for w in workers) >= 1


@pytest.mark.parametrize(
    ("asked", "refusal"),
    [
        ("reward.ray_resource=grader", r"reward\.ray_resource='grader': no node of the cluster"),
        ("runtime.engines=3", r"engine_cpus=1\.0 needs 3 CPUs; the cluster has 2"),
    ],
    ids=["a-reward-resource-no-node-declares", "engines-the-cluster-cannot-hold"],
)
def test_what_the_cluster_cannot_give_is_refused_before_any_actor_starts(
    two_nodes: Cluster, asked: str, refusal: str
) -> None:
    cfg = load_config(None, [*RAY_RUN, asked])

    async def start() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(start_fleet(cfg, stack))

    with pytest.raises(ValueError, match=refusal):
        asyncio.run(start())
    assert ray.util.list_named_actors() == []


def sandboxes_left(workers: set[int], timeout_s: float = 10.0) -> set[int]:
    """The sandbox processes of the pools of the rollout worker processes `workers` (pids, the
    killed ones included) still there after up to `timeout_s`: only this test's, however many
    other runs on the machine have sandboxes."""
    return left_after(lambda: pool_processes(workers), timeout_s)


def test_a_killed_rollout_worker_costs_its_episodes_as_infra_failures_and_the_run_completes(
    two_nodes: Cluster, tmp_path: Path, warm_started_small: list[str]
) -> None:
    metrics, report, killed = run_killing("rollout-0", tmp_path, warm_started_small)
    restarted, other = report["workers"]
    assert (restarted["restarts"], other["restarts"]) == (1, 0)
    # The episodes worker 0 held were replaced, not scored.
    assert sum(m["infra_failures"] for m in metrics) >= 1
    assert report["trajectories_on_several_engines"] == []
    for r in read_records(tmp_path):
        assert (r["reward"] is None) == (r["finish"] == Finish.INFRA.value)
        # Every token is within the staleness bound, including any the restarted engine served
        # (its start-up weights would be version 0).
        trained_at = metrics[r["step"]]["weight_version"] - 1
        assert all(0 <= trained_at - int(v) <= 1 for v in r["versions"])
    # The killed pool's sandboxes were reaped (by its successor, or with the run); the rest
    # closed with the run.
    assert not sandboxes_left({killed, restarted["pid"], other["pid"]})


class KillNodeAfterFirstStep(threading.Thread):
    """Take a node away mid-step, as a machine that fails would (its raylet and every process
    on it killed): the node of a rollout worker that plays episodes, once the run in `run_dir`
    has finished its first step. Not the head node, where the driver's cluster services run."""

    def __init__(self, cluster: Cluster, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.cluster, self.run_dir = cluster, run_dir
        self.killed = threading.Event()
        self.node = ""  # the killed node's id
        self.worker = -1
        self.pids: set[int] = set()  # the killed node's rollout worker
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 600
        metrics = self.run_dir / "metrics.jsonl"
        head = self.cluster.head_node.node_id
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                for i in range(2):
                    worker = ray.get_actor(f"rollout-{i}", namespace=NAMESPACE)
                    report = ray.get(worker.report.remote())
                    if report["node"] != head and playing(report):
                        (node,) = (n for n in self.cluster.list_all_nodes()
                                   if n.node_id == report["node"])  # fmt: skip
                        self.node, self.worker, self.pids = node.node_id, i, {report["pid"]}
                        self.cluster.remove_node(node, allow_graceful=False)
                        self.killed.set()
                        return
            time.sleep(0.01)


@pytest.mark.slow  # the default suite kills a worker's process (above)
def test_a_node_killed_mid_step_loses_no_trajectory_and_the_run_goes_on_on_the_other_node(
    two_nodes: Cluster, tmp_path: Path, warm_started_small: list[str]
) -> None:
    steps = 6
    cfg = load_config(None, [*warm_started_small, *ON_TWO_ENGINES, f"run.steps={steps}"])
    killer = KillNodeAfterFirstStep(two_nodes, tmp_path)
    try:
        metrics = asyncio.run(train(cfg, tmp_path))
    finally:
        killer.join()
        # The module's later tests get their two nodes back.
        two_nodes.add_node(num_cpus=1, object_store_memory=256 << 20)
        two_nodes.wait_for_nodes()
    assert killer.killed.is_set()
    # Every step trained its whole batch: the episodes on the lost node were played again.
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["groups"] == 2 for m in metrics)
    assert sum(m["infra_failures"] for m in metrics) >= 1
    report = json.loads((tmp_path / "cluster.json").read_text())
    # The fleet saw the worker lost at once (Ray's own health check marks the node dead only
    # ~15 s later, when it restarts the actor elsewhere: this run may be over by then).
    lost = report["workers"][killer.worker]
    assert lost["restarts"] == 1
    assert report["trajectories_on_several_engines"] == []
    records = list(read_records(tmp_path))
    assert len(records) >= steps * 2 * 2
    for r in records:
        # A trajectory the node took with it is replaced, never scored (0 or otherwise).
        assert (r["reward"] is None) == (r["finish"] == Finish.INFRA.value)
        trained_at = metrics[r["step"]]["weight_version"] - 1
        assert all(0 <= trained_at - int(v) <= 1 for v in r["versions"])
    workers = killer.pids | {w["pid"] for w in report["workers"] if w["pid"] is not None}
    assert not sandboxes_left(workers)


def test_an_episode_whose_sandbox_is_preempted_moves_to_the_other_worker_and_goes_on_there(
    two_nodes: Cluster, tmp_path: Path, warm_started_small: list[str]
) -> None:
    # 70 % of the sandboxes are preempted by their pool in their first 0.25 s (an episode of
    # this small run takes about 0.2 s), as a node running short of memory would: an episode
    # cut after its first turn moves to the other worker and is replayed there.
    steps = 6
    faults = ["faults.preempt_sandboxes=0.7", "faults.fault_within_s=0.25"]
    cfg = load_config(None, [*warm_started_small, *ON_TWO_ENGINES, f"run.steps={steps}", *faults])
    metrics = asyncio.run(train(cfg, tmp_path))
    assert [m["step"] for m in metrics] == list(range(steps))
    report = json.loads((tmp_path / "cluster.json").read_text())
    moved = set(report["migrated_trajectories"])
    assert report["migrated_completed"] >= 1 and len(moved) >= report["migrated_completed"]
    # Only the moved episodes reached a second engine; the rest stayed where their KV was.
    assert set(report["trajectories_on_several_engines"]) <= moved
    assert sum(w["pool"]["preemptions"] for w in report["workers"]) >= len(moved)
    records = list(read_records(tmp_path))
    assert any(r["trajectory_id"] in moved and r["reward"] is not None for r in records)
    for r in records:
        assert (r["reward"] is None) == (r["finish"] == Finish.INFRA.value)
        trained_at = metrics[r["step"]]["weight_version"] - 1
        assert all(0 <= trained_at - int(v) <= 1 for v in r["versions"])


class RankDiesMidway:
    """`trainer`'s weights, whose stream breaks after a few tensors (as when a rank dies)."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer, self.version = trainer, trainer.version + 1

    def hf_weights(self) -> WeightStream:
        stream = self.trainer.hf_weights()

        def broken() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(stream):
                if i == 8:
                    raise ConnectionError("trainer rank 1 died")
                yield item

        return WeightStream(stream.manifest, broken())


def test_a_publish_reaches_every_engine_a_bucket_at_a_time_and_a_broken_one_passes_for_no_version(
    two_nodes: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [*RAY_RUN, "trainer.publish_bucket_mib=0.0625"])
    start, trained = (
        init_model_dir(tmp_path / name, preset=cfg.run.preset, seed=seed)
        for name, seed in (("start", 0), ("trained", 1))
    )
    trainer = GRPOTrainer(load_model(trained, "cpu"), cfg.trainer, version=2)
    core = ray._private.worker.global_worker.core_worker
    buckets: list[bytes] = []  # the object ids put, hex
    held: list[int] = []  # at each put, how many of the earlier are still in the store

    def put(value: Any) -> ray.ObjectRef:
        live = core.get_all_reference_counts()
        held.append(sum(b in live for b in buckets))
        ref = ray_put(value)
        buckets.append(ref.hex().encode())
        return ref

    def engine_weights(worker: Any) -> tuple[dict[str, torch.Tensor], int, str | None]:
        engine = worker.engine.engine.engine  # LocalEngine, AsyncEngine, Engine
        weights = {k: v.clone() for k, v in engine.model.hf_state_dict().items()}
        return weights, engine.weight_version, engine.model.torn

    async def scenario() -> list[tuple[dict[str, torch.Tensor], int, str | None]]:
        async with RolloutFleet(cfg, RayCluster(cfg.runtime)) as fleet:
            await fleet.prepare_template(TreasureHunt.template)
            await fleet.start_engines(start, 0, SamplingParams(temperature=1.0))
            with pytest.raises(ConnectionError, match="rank 1 died"):
                await fleet.publish(RankDiesMidway(trainer), tmp_path, start)  # type: ignore[arg-type]
            for worker in fleet.workers:
                # Half copied: the engine keeps its version and runs nothing until a whole set.
                _, version, torn = await worker.__ray_call__.remote(engine_weights)
                assert version == 0 and torn is not None and "ConnectionError" in torn
            monkeypatch.setattr(ray, "put", put)
            await fleet.publish(trainer, tmp_path, start)
            monkeypatch.undo()
            return [await w.__ray_call__.remote(engine_weights) for w in fleet.workers]

    ray_put = ray.put
    engines = asyncio.run(scenario())
    expected = trainer.model.hf_state_dict()
    total = sum(t.nbytes for t in expected.values())
    assert len(buckets) >= total / 2**20 / 0.0625 / 2  # many buckets, not one object
    assert max(held) == 0, f"{max(held)} buckets were still in the store when the next went in"
    for weights, version, torn in engines:
        assert version == 2 and torn is None
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in expected)


def fleet_setup(tmp_path: Path, version: int) -> tuple[Config, Path, GRPOTrainer]:
    """For a test of the fleet on its own: the config on two engines, a model directory and a
    trainer whose weights are at `version`."""
    cfg = load_config(None, [*RAY_RUN, "rollout.max_context=4096", "rollout.max_tokens_per_turn=8"])
    model_dir = tmp_path / "model"
    init_model_dir(model_dir, preset=cfg.run.preset, seed=0)
    return cfg, model_dir, GRPOTrainer(load_model(model_dir, "cpu"), cfg.trainer, version=version)


async def serve(
    fleet: RolloutFleet, env: type[Environment], model: Path, trainer: GRPOTrainer, tmp: Path
) -> None:
    """Every engine up with `env`'s template and the trainer's weights published."""
    await fleet.prepare_template(env.template)
    await fleet.start_engines(model, 0, SamplingParams(temperature=1.0))
    await fleet.publish(trainer, tmp, model)


@pytest.mark.slow  # the default suite's time; a killed worker's run completes in it (above)
def test_a_restarted_worker_gets_the_templates_and_the_model_back_and_serves_from_the_next_publish(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    # The fleet on its own, so that the test waits for Ray's restart however long it takes
    # on a loaded machine, instead of hoping a run of N steps outlasts it.
    cfg, model_dir, trainer = fleet_setup(tmp_path, version=3)
    tasks = TreasureHunt.tasks(0)
    workers: set[int] = set()  # their processes, the killed one's included
    model_copies = set(Path(tempfile.gettempdir()).glob("venusrl-engine-*"))

    async def scenario() -> None:
        async with RolloutFleet(cfg, RayCluster(cfg.runtime)) as fleet:
            await serve(fleet, TreasureHunt, model_dir, trainer, tmp_path)

            async def open_group(gid: str) -> RemoteGroup:
                return await fleet.open_group(gid, TreasureHunt, next(tasks), 1)

            def played(traj: Trajectory) -> bool:
                versions = [v for v, m in zip(traj.versions, traj.mask, strict=True) if m]
                return traj.finish is not Finish.INFRA and set(versions) == {trainer.version}

            group = await open_group("g0")
            assert played(await group.play("g0-a", lambda p, age: None))
            held = group.worker
            workers.add((await fleet.workers[held].report.remote())["pid"])
            ray.kill(fleet.workers[held], no_restart=False)
            # Episodes in flight there, or sent before Ray notices, fail as the platform's fault.
            for _ in range(100):
                traj = await group.play("g0-b", lambda p, age: None)
                if traj.finish is Finish.INFRA:
                    break
                await asyncio.sleep(0.05)
            assert traj.finish is Finish.INFRA and traj.reward is None
            # The group's next member plays on a worker that is up, its group opened there.
            assert played(await group.play("g0-c", lambda p, age: None))
            assert fleet.is_up(group.worker, group.epoch) and fleet.reopened_groups == 1
            await group.close()
            # Back with the start model, it waits out of service for the next publish (the
            # fleet holds no copy of the weights to give it): a run's next step.
            trainer.version = 4
            deadline = time.monotonic() + 300
            while held not in fleet.replicas.up:
                assert time.monotonic() < deadline, "the killed worker never came back"
                await asyncio.sleep(0.2)
                await fleet.publish(trainer, tmp_path, model_dir)
            # Two groups at once go to the two workers, the restarted one included, and both
            # play with the weights of that publish.
            groups = [await open_group(g) for g in ("g1", "g2")]
            assert {g.worker for g in groups} == {0, 1}
            for g in groups:
                assert played(await g.play(f"{g.group_id}-a", lambda p, age: None))
                await g.close()
            report = await fleet.report()
            assert [w["restarts"] for w in report["workers"]][held] == 1
            workers.update(w["pid"] for w in report["workers"])

    asyncio.run(scenario())
    assert len(workers) == 3 and not sandboxes_left(workers)
    # The killed worker left no copy of the model behind.
    assert set(Path(tempfile.gettempdir()).glob("venusrl-engine-*")) == model_copies


@pytest.mark.slow  # the default suite's time (~13 s); the book keeps a report's start too
def test_a_tool_call_relayed_from_a_worker_is_dated_when_it_began_not_when_the_driver_heard(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    # A worker's reports reach the driver only with the return of another episode there; the
    # ranking reads how long a member has waited on its tool from them, so each must carry when
    # it was made. Member 0 waits 6 s in its first tool call while members of 1 s each end on
    # the same worker: every relay of its one report must date it the same.
    cfg, model_dir, trainer = fleet_setup(tmp_path, version=1)
    slow = {"tool_s": (6.0, 0.0), "observation_chars": (8, 8), "reward": 1.0}
    quick = {"tool_s": (1.0,), "observation_chars": (8,), "reward": 0.0}
    task = Task(id="relay-0", prompt="work", reference={"members": [slow, *[quick] * 15]})
    heard: list[tuple[Progress, float, float]] = []  # member 0's: report, when made, when heard

    def hear(p: Progress, age: float) -> None:
        now = time.monotonic()
        heard.append((p, now - age, now))

    async def scenario() -> None:
        async with RolloutFleet(cfg, RayCluster(cfg.runtime)) as fleet:
            await serve(fleet, AgentWorkload, model_dir, trainer, tmp_path)
            group = await fleet.open_group("relay", AgentWorkload, task, 1)
            first = asyncio.create_task(group.play("relay-m0", hear))
            await asyncio.sleep(1.0)  # it takes the first draw: the members draw in turn
            for i in range(1, 16):  # until member 0's tool call has been relayed twice
                traj = await group.play(f"relay-m{i}", lambda p, age: None)
                assert traj.finish is not Finish.INFRA, traj.failure
                if sum(p.in_tool and p.turns == 1 for p, _, _ in heard) >= 2 or first.done():
                    break
            assert (await first).finish is not Finish.INFRA
            await group.close()

    asyncio.run(scenario())
    in_tool = [(made, at) for p, made, at in heard if p.in_tool and p.turns == 1]
    assert len(in_tool) >= 2, heard
    (made_first, heard_first), (made_last, heard_last) = in_tool[0], in_tool[-1]
    assert heard_last - heard_first > 0.5  # heard a quick member's episode (1 s) apart...
    assert abs(made_last - made_first) < 0.25  # ...dated the same: when the call began


@pytest.mark.slow  # the default suite's time: run by scripts/test.sh --slow
def test_a_worker_that_dies_again_while_waiting_for_weights_is_revived_again_and_serves(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    cfg, model_dir, trainer = fleet_setup(tmp_path, version=3)
    tasks = TreasureHunt.tasks(0)

    async def until(done: Any, fleet: RolloutFleet, what: str) -> None:
        """Until `done()`, the fleet's calls noticing deaths meanwhile; 300 s at most, however
        long Ray's restarts take on a loaded machine."""
        deadline = time.monotonic() + 300
        while not done():
            assert time.monotonic() < deadline, what
            await fleet.pool_stats()  # a call to every worker up: a dead one is found so
            await asyncio.sleep(0.2)

    async def scenario() -> None:
        async with RolloutFleet(cfg, RayCluster(cfg.runtime)) as fleet:
            await serve(fleet, TreasureHunt, model_dir, trainer, tmp_path)
            ray.kill(fleet.workers[0], no_restart=False)
            await until(lambda: fleet.waiting_for_weights() == [0], fleet, "never restarted")
            # A publish that fails (a trainer rank died) leaves it waiting for the next.
            with pytest.raises(ConnectionError, match="rank 1 died"):
                await fleet.publish(RankDiesMidway(trainer), tmp_path, model_dir)  # type: ignore[arg-type]
            assert fleet.waiting_for_weights() == [0]
            # Dead again before it was back in service: Ray restarts it once more, and so
            # does the fleet (it kept it out for good, as if it had no restarts left).
            ray.kill(fleet.workers[0], no_restart=False)
            trainer.version = 4

            async def publish() -> None:
                await fleet.publish(trainer, tmp_path, model_dir)

            deadline = time.monotonic() + 300
            while 0 not in fleet.replicas.up:
                assert time.monotonic() < deadline, "the twice-killed worker never came back"
                await publish()
                await asyncio.sleep(0.2)
            assert fleet.replicas.restarts == [2, 0] and fleet.waiting_for_weights() == []
            # It plays with the weights of the publish that brought it back.
            groups = [await fleet.open_group(g, TreasureHunt, next(tasks), 1) for g in ("g1", "g2")]
            assert {g.worker for g in groups} == {0, 1}
            for g in groups:
                traj = await g.play(f"{g.group_id}-a", lambda p, age: None)
                versions = {v for v, m in zip(traj.versions, traj.mask, strict=True) if m}
                assert traj.finish is not Finish.INFRA and versions == {4}
                await g.close()

    asyncio.run(scenario())


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
    assert all(w["episodes_played"] > 0 and w["groups_placed"] > 0 for w in report["workers"])


@pytest.mark.parametrize(
    ("address", "words"),
    [("127.0.0.1:1", "nothing answers at 127.0.0.1:1"), ("nonsense", "is not host:port")],
)
def test_a_cluster_address_nobody_answers_on_is_an_error_at_once(address: str, words: str) -> None:
    with pytest.raises(ValueError, match=f"runtime.address: .*{words}"):
        check_reachable(address)
