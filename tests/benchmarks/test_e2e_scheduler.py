"""The end-to-end scheduler benchmark runs `venusrl train` under each policy and reports what it
claims to report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.benchmarks import refused, run_benchmark

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="sandboxes need root for namespaces and cgroups"
)


@pytest.mark.slow
def test_it_runs_each_policy_to_the_same_number_of_batches_and_reports_ratios(
    tmp_path: Path,
) -> None:
    args = ["--batches", "2", "--groups-per-batch", "1", "--group-size", "2"]
    proc = run_benchmark("e2e_scheduler.py", *args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for policy in ("fifo", "overlap", "venus"):
        res = out[policy]
        assert len(res["step_wall_s"]) == 2 and res["time_to_batches_s"] > 0
        spent = res["batch_wait_s"] + res["train_s"] + res["publish_s"]
        assert min(res["batch_wait_s"], res["train_s"], res["publish_s"]) >= 0
        assert spent <= res["time_to_batches_s"] + 0.2
        assert 0 <= res["later_batch_wait_s"] <= res["batch_wait_s"]
        assert res["group_s_max"] >= res["group_s_p90"] >= res["group_s_p50"] > 0
        assert res["groups_started"] >= 2 + res["groups_running_at_end"]
        assert 0 <= res["staleness_mean"] <= res["staleness_max"] <= 4
        assert 0 < res["engine_busy_share"] < 1 and res["engine"]["generated_tokens"] > 0
        assert res["tool_return_wait_mean_s"] > 0
        assert 0 < res["critical_generation_share"] < 1
    assert out["overlap"]["engine"]["offloaded_bytes"] == 0  # LRU drops, never offloads
    assert out["fifo"]["staleness_max"] == 0  # synchronous: on-policy
    assert "rollout.max_train_staleness=4" in out["venus"]["knobs"]
    assert "rollout.max_train_staleness=4" in out["overlap"]["knobs"]
    for base in ("fifo", "overlap"):
        ratio = out[base]["time_to_batches_s"] / out["venus"]["time_to_batches_s"]
        assert out[f"speedup_vs_{base}"] == round(ratio, 3)
        unwaited = out["venus"]["time_to_batches_s"] - out["venus"]["later_batch_wait_s"]
        ceiling = out[base]["time_to_batches_s"] / unwaited
        assert out[f"speedup_ceiling_vs_{base}"] == round(ceiling, 3) >= out[f"speedup_vs_{base}"]


def test_unknown_policies_and_bad_bounds_are_refused_by_name() -> None:
    code, stderr = refused("e2e_scheduler.py", "--policies", "venus,lifo")
    assert code != 0 and "lifo" in stderr
    code, stderr = refused("e2e_scheduler.py", "--train-staleness", "0")
    assert code != 0 and "--train-staleness must be >= 1" in stderr


def test_the_engine_share_is_taken_of_each_groups_longest_member(tmp_path: Path) -> None:
    from benchmarks.e2e_scheduler import critical_generation_share

    def record(group: str, *turns: tuple[float, float, float]) -> str:
        keys = ("requested", "generated", "acted")
        return json.dumps(
            {
                "step": 0,
                "group_id": group,
                "turns": [dict(zip(keys, t, strict=True)) for t in turns],
            }
        )

    lines = [
        record("a", (0, 1, 2), (2, 3, 10)),  # a's longest: 10 s, 2 of them at the engine
        record("a", (0, 4, 5)),  # shorter, though mostly at the engine: not a's critical path
        record("b", (1, 4, 11)),  # b's only member: 10 s, 3 at the engine
    ]
    (tmp_path / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    assert critical_generation_share(tmp_path) == pytest.approx((2 + 3) / (10 + 10))


def test_an_offload_baseline_is_its_plain_form_with_the_host_tier_and_no_priorities() -> None:
    from benchmarks.e2e_scheduler import knobs

    plain, offload = knobs("overlap", 4), knobs("overlap+offload", 4)
    assert "engine.retention=trajectory" in offload and "engine.retention=lru" not in offload
    assert set(plain) - set(offload) == {"engine.retention=lru"}
    assert "rollout.priorities=fifo" in offload and "rollout.max_train_staleness=4" in offload
    code, stderr = refused("e2e_scheduler.py", "--policies", "venus,venus+offload")
    assert code != 0 and "venus+offload" in stderr


def test_released_start_places_go_to_every_policy_that_runs_ahead_and_to_no_other() -> None:
    from benchmarks.e2e_scheduler import knobs

    for policy in ("overlap", "overlap+offload", "venus"):
        assert "rollout.release_overtaken=true" in knobs(policy, 4, release_overtaken=True)
        assert "rollout.release_overtaken=true" not in knobs(policy, 4)
    assert "rollout.release_overtaken=true" not in knobs("fifo", 4, release_overtaken=True)
