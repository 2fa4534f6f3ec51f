"""The work floor: the least rollout GPU time a trained sample needs, whatever schedules it."""

from __future__ import annotations

import pytest

from venusrl.sim.cost_model import CostModel
from venusrl.sim.work_floor import Work, floor_step_s, trajectory_work
from venusrl.workloads import TrajectoryPlan, TurnPlan

COST = CostModel.preset("qwen3-4b", "h200")


def plan(prompt: int, *turns: TurnPlan) -> TrajectoryPlan:
    return TrajectoryPlan(
        prompt_tokens=prompt,
        turns=turns,
        sandbox_start_s=0.0,
        reward_s=0.0,
        success=True,
        infra_failure_turn=None,
        sandbox_rss_gb=1.0,
    )


@pytest.mark.parametrize("batch", [1, 16])
def test_decode_work_in_its_terms_is_the_iterations_that_do_it_summed(batch: int) -> None:
    context, tokens = 3000, 50
    together = sum(COST.decode_step_s(batch, batch * (context + j)) for j in range(tokens))
    reads = batch * (tokens * context + tokens * (tokens - 1) / 2)
    assert COST.decode_s(tokens, batch * tokens, reads) == pytest.approx(together)


def test_a_trajectory_s_work_decodes_each_action_after_its_context_and_prefills_once() -> None:
    p = plan(1000, TurnPlan(100, 400, 2.0), TurnPlan(50, 0, 0.0))
    template, k = 10, 8
    first = trajectory_work(p, 1, template, k, COST)
    assert first.prefill_s == pytest.approx(COST.prefill_s(1000, 0) / k)
    # The prompt's prefill samples the first token; the 99 after it are decoded.
    assert (first.tokens, first.reads) == (99, 99 * 1000 + 99 * 98 / 2)
    assert first.own_reads == 99 * 98 / 2  # the prompt is not the trajectory's own
    both = trajectory_work(p, 2, template, k, COST)
    assert both.prefill_s == pytest.approx(first.prefill_s + COST.prefill_s(410, 1100))
    assert both.tokens == 99 + 49
    assert both.reads == first.reads + 49 * 1510 + 49 * 48 / 2
    assert both.own_reads == first.own_reads + 49 * 510 + 49 * 48 / 2


def test_short_contexts_share_an_iteration_s_fixed_cost_among_a_full_batch() -> None:
    work = Work(prefill_s=1.0, tokens=25_600, reads=25_600 * 1000, own_reads=25_600 * 500)
    assert work.gpu_s(COST, max_batch=256) == pytest.approx(
        1.0 + COST.decode_s(100, 25_600, 25_600 * 1000)
    )


def test_long_contexts_take_as_many_iterations_as_the_device_s_kv_needs_for_their_reads() -> None:
    own = 40 * COST.kv_capacity_tokens  # reads no 40 iterations could hold on one device
    work = Work(tokens=256, reads=own, own_reads=own)
    assert work.gpu_s(COST, max_batch=256) == pytest.approx(COST.decode_s(40, 256, own))
    assert work.gpu_s(COST, max_batch=256) > COST.decode_s(1, 256, own)


def test_work_adds_up_term_by_term() -> None:
    assert Work(1.0, 2, 3.0, 4.0) + Work(0.5, 1, 1.0, 1.0) == Work(1.5, 3, 4.0, 5.0)


def test_the_floor_step_divides_the_work_among_the_engines_and_adds_the_weight_load() -> None:
    assert floor_step_s(gpu_s=800.0, steps=2, engines=4, weight_sync_s=3.0) == 103.0
