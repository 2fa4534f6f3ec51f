"""Seeded, sourced workloads and the workload file format."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from venusrl.workloads import (
    SCENARIOS,
    Constant,
    LogNormal,
    Mixture,
    ToolLatency,
    WorkloadSampler,
    load_workload,
)


def test_the_same_seed_draws_the_same_trajectories_whatever_the_order() -> None:
    a, b = WorkloadSampler(SCENARIOS["swe-long"], 3), WorkloadSampler(SCENARIOS["swe-long"], 3)
    pa, pb = a.next_prompt(), b.next_prompt()
    assert pa == pb
    # A member's draw depends on its prompt and index, not on who was drawn before it.
    first = [a.trajectory(pa, i) for i in range(8)]
    second = [b.trajectory(pb, i) for i in reversed(range(8))][::-1]
    assert first == second
    assert a.trajectory(pa, 0, attempt=1) != first[0]  # a replacement is a new draw


def test_turn_and_context_caps_hold() -> None:
    w = SCENARIOS["swe-short"]
    sampler = WorkloadSampler(w, 0)
    for _ in range(40):
        prompt = sampler.next_prompt()
        plan = sampler.trajectory(prompt, 0)
        assert 1 <= len(plan.turns) <= w.turn_cap
        total = plan.prompt_tokens + sum(
            t.action_tokens + t.observation_tokens + w.template_tokens for t in plan.turns
        )
        assert total <= w.context_cap + w.template_tokens
        assert plan.turns[-1].observation_tokens == 0 and plan.turns[-1].tool_s == 0


def test_swe_long_turns_follow_the_sourced_median() -> None:
    sampler = WorkloadSampler(SCENARIOS["swe-long"], 1)
    turns = sorted(len(sampler.trajectory(sampler.next_prompt(), 0).turns) for _ in range(400))
    assert 45 <= turns[len(turns) // 2] <= 70  # LN(57, ~0.5)
    assert turns[-1] <= 300


def test_a_workload_file_overrides_its_base_by_field_name(tmp_path: Path) -> None:
    f = tmp_path / "mine.yaml"
    f.write_text(
        "base: swe-short\n"
        "prompts_per_batch: 8\n"
        "action_tokens: {lognormal: {median: 100, sigma: 0.5, max: 400}}\n"
        "sandbox_start_s:\n"
        "  mixture: [{p: 0.5, constant: 1}, {p: 0.5, lognormal: {median: 9, sigma: 1}}]\n"
    )
    w = load_workload(f)
    assert w.name == "mine" and w.prompts_per_batch == 8 and w.turn_cap == 50
    assert w.action_tokens == LogNormal(100, 0.5, 0.0, 400)
    assert isinstance(w.sandbox_start_s, Mixture)


def test_a_workload_file_may_grade_every_reward_at_once_or_bound_the_graders(
    tmp_path: Path,
) -> None:
    f = tmp_path / "graders.yaml"
    f.write_text("reward_workers: null\n")
    assert load_workload(f).reward_workers is None
    f.write_text("reward_workers: 8\n")
    assert load_workload(f).reward_workers == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prompts_per_batchh: 8\n", "unknown field"),
        ("action_tokens: {lognormal: {median: 100}}\n", "median and sigma"),
        ("action_tokens: {weibull: 3}\n", "unknown distribution"),
        ("reward_s: {mixture: [{p: 0.3, constant: 1}]}\n", "sum to 1"),
        ("base: nope\n", "unknown scenario"),
        ("turns: {kind: lognormal, sigmaa: 1}\n", "turns: .* is not a valid value"),
        ("success_beta: [1]\n", "success_beta: needs two numbers"),
        ("group_size: 1\n", "group_size must be >= 2"),
        ("prompts_per_batch: many\n", "prompts_per_batch: needs a int, got 'many'"),
        ("action_tokens: [unclosed\n", "not valid YAML"),
        ("", "empty; a workload file sets Workload fields"),
        ("# nothing but a comment\n", "empty"),
        ("tp: 1.7\n", "tp: needs a int"),
        ("sandbox: 'false'\n", "sandbox: needs a bool"),
        ("sources: [a, b]\n", "sources: needs a mapping"),
        ("reward_s: {constant: abc}\n", "reward_s: .*could not convert"),
        ("action_tokens: .inf\n", "action_tokens: .*finite"),
        ("action_tokens: .nan\n", "action_tokens: .*finite"),
        ("action_tokens: {lognormal: {median: -100, sigma: 0.5}}\n", "median > 0"),
        ("action_tokens: {lognormal: {median: 9, sigma: 0.5, min: 500, max: 10}}\n", "min <= max"),
        ("reward_s: {mixture: [{p: 1.5, constant: 1}, {p: -0.5, constant: 2}]}\n", "in \\[0, 1\\]"),
        ("turns: {kind: banana}\n", "kind must be lognormal, binomial or poisson"),
        ("turns: {kind: lognormal}\n", "needs prompt_median"),
        ("tool_s: {body: 1, hang_p: 2}\n", "probabilities"),
        ("infra_failure_rate: 1\n", r"infra_failure_rate must be in \[0, 1\)"),
        ("rollout_gpus: 10000000\n", "rollout_gpus must be <= 100000"),
        ("prompts_per_batch: 1000000\n", "1,000,000 trajectories"),
        ("trajectory_limit_s: 0\n", "trajectory_limit_s must be > 0"),
        ("trajectory_limit_s: .inf\n", "trajectory_limit_s: needs a float"),
        ("reward_workers: 0\n", r"reward_workers must be in \[1, 1000000\] or null"),
        ("reward_workers: true\n", "reward_workers: needs a count of graders or null"),
        ("reward_workers: 2.5\n", "reward_workers: needs a count of graders or null"),
    ],
)
def test_a_bad_workload_file_says_which_field(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_workload(f)


def test_a_scaled_tool_latency_scales_every_duration_and_keeps_every_probability() -> None:
    tool = SCENARIOS["swe-long"].tool_s
    quarter = tool.scaled(0.25)
    assert (quarter.heavy_p, quarter.hang_p) == (tool.heavy_p, tool.hang_p)
    assert quarter.hang_s == tool.hang_s / 4
    a, b = random.Random(7), random.Random(7)
    draws = [(tool.sample(a, 3.0), quarter.sample(b, 3.0)) for _ in range(2000)]
    assert all(q == pytest.approx(t / 4) for t, q in draws)
    assert any(t > 10 for t, _ in draws)  # the heavy tail was drawn, and scaled


def test_the_caps_bound_the_heavy_and_hang_probabilities_of_a_slow_task() -> None:
    capped = ToolLatency(
        Constant(0.1), heavy_p=0.02, heavy=Constant(20.0), hang_p=0.001, hang_s=450.0,
        heavy_p_max=0.2, hang_p_max=0.01,
    )  # fmt: skip
    uncapped = dataclasses.replace(capped, heavy_p_max=1.0, hang_p_max=1.0)
    rng, n = random.Random(5), 20_000
    for multiplier, heavy_p, hang_p in ((2.0, 0.04, 0.002), (50.0, 0.2, 0.01)):
        assert capped.probabilities(multiplier) == pytest.approx((heavy_p, hang_p))
        draws = [capped.sample(rng, multiplier) for _ in range(n)]
        # Binomial: within about 4.5 standard deviations of the capped probabilities.
        for value, p in ((20.0, heavy_p), (450.0, hang_p)):
            share = draws.count(value) / n
            assert abs(share - p) < 4.5 * (p * (1 - p) / n) ** 0.5 + 1 / n
    # Uncapped, the slow task's calls are all heavy or hung.
    assert all(uncapped.sample(rng, 50.0) > 1 for _ in range(1000))


def test_a_workload_file_sets_the_caps_and_refuses_a_cap_above_one(tmp_path: Path) -> None:
    f = tmp_path / "capped.yaml"
    f.write_text("tool_s: {body: 1, heavy_p: 0.02, heavy: 30, heavy_p_max: 0.1, hang_p_max: 0}\n")
    tool = load_workload(f).tool_s
    assert (tool.heavy_p_max, tool.hang_p_max) == (0.1, 0.0)
    f.write_text("tool_s: {body: 1, hang_p_max: 1.5}\n")
    with pytest.raises(ValueError, match="hang_p_max are probabilities"):
        load_workload(f)


def test_the_h100_workload_file_is_swe_long_on_h100s() -> None:
    """`benchmarks/workloads/swe-long-h100.yaml`: the same workload and fleet, nothing else."""
    path = Path(__file__).parents[1] / "benchmarks" / "workloads" / "swe-long-h100.yaml"
    h100 = load_workload(path)
    assert h100 == dataclasses.replace(SCENARIOS["swe-long"], name="swe-long-h100", gpu="h100")
