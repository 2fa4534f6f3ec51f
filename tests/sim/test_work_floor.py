"""The work floor: the least rollout GPU time a trained sample needs, whatever schedules it."""

from __future__ import annotations

import pytest

from venusrl.sim.cost_model import CostModel
from venusrl.sim.work_floor import floor_step_s, trajectory_work_s
from venusrl.workloads import TrajectoryPlan, TurnPlan

COST = CostModel.preset("qwen3-4b", "h200")


@pytest.mark.parametrize("batch", [1, 16])
def test_the_decode_floor_is_what_identical_requests_batched_together_cost_each(batch: int) -> None:
    context, tokens = 3000, 50
    together = sum(COST.decode_step_s(batch, batch * (context + j)) for j in range(tokens))
    assert batch * COST.decode_floor_s(context, tokens, batch) == pytest.approx(together)
    # A fuller iteration shares its fixed cost with more requests: a lower floor.
    assert COST.decode_floor_s(context, tokens, 256) < COST.decode_floor_s(context, tokens, 1)


def test_a_trajectory_s_floor_decodes_each_action_after_its_context_and_prefills_once() -> None:
    plan = TrajectoryPlan(
        prompt_tokens=1000,
        turns=(TurnPlan(100, 400, 2.0), TurnPlan(50, 0, 0.0)),
        sandbox_start_s=0.0,
        reward_s=0.0,
        success=True,
        infra_failure_turn=None,
        sandbox_rss_gb=1.0,
    )
    template, k, batch = 10, 8, 64
    first = COST.prefill_s(1000, 0) / k + COST.decode_floor_s(1000, 100, batch)
    second = COST.prefill_s(410, 1100) + COST.decode_floor_s(1510, 50, batch)
    assert trajectory_work_s(plan, 1, COST, template, k, batch) == pytest.approx(first)
    assert trajectory_work_s(plan, 2, COST, template, k, batch) == pytest.approx(first + second)


def test_the_floor_step_divides_the_work_among_the_engines_and_adds_the_weight_load() -> None:
    assert floor_step_s(work_s=800.0, steps=2, engines=4, weight_sync_s=3.0) == 103.0
