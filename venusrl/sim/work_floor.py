"""The least rollout GPU time a trained sample needs, whatever schedules it.

Where the engines are never idle, a step cannot be shorter than the GPU work of the samples it
trains divided among the engines, and no scheduler can take that work away: every generated token
reads the KV of the tokens before it, every prompt and observation is prefilled once. A schedule
only adds to it (KV computed again after an eviction, copies to and from the host tier, engines
idle while agents wait on tools) or saves on the iteration's fixed cost by batching more. So
`floor_step_s` is a lower bound on a throughput-bound step, the complement of the `--unloaded`
run (`benchmarks/sim_scenarios.py`), which bounds a latency-bound one by the batches' critical
path: a policy's step over its floor is the most any schedule of its engines could gain where
rollout sets the pace.

Counted here, per trajectory, from its plan and the turns it ran: the decode of each action after
its context, at most `max_batch` requests sharing an iteration (`CostModel.decode_floor_s`); the
prefill of each observation after the context before it; its group's prompt once, shared by its
members (the radix cache's best). Left out, so the floor stays below what any schedule reaches:
the attempts the platform failed, and the context lost to a cut.
"""

from __future__ import annotations

from venusrl.sim.cost_model import CostModel
from venusrl.workloads import TrajectoryPlan


def trajectory_work_s(
    plan: TrajectoryPlan,
    turns: int,
    cost: CostModel,
    template_tokens: int,
    group_size: int,
    max_batch: int,
) -> float:
    """GPU seconds of the first `turns` turns of `plan` (the actions decoded, the observations
    between them prefilled), and its share of its group's prompt."""
    seconds = cost.prefill_s(plan.prompt_tokens, 0) / group_size
    context = plan.prompt_tokens
    for i, turn in enumerate(plan.turns[:turns]):
        seconds += cost.decode_floor_s(context, turn.action_tokens, max_batch)
        context += turn.action_tokens
        if i < turns - 1:  # the observation the next turn reads
            observed = turn.observation_tokens + template_tokens
            seconds += cost.prefill_s(observed, context)
            context += observed
    return seconds


def floor_step_s(work_s: float, steps: int, engines: int, weight_sync_s: float) -> float:
    """The step time if `engines` did nothing but the `work_s` GPU seconds that `steps` trained
    batches need, each step also pausing them `weight_sync_s` to load new weights."""
    return work_s / (steps * engines) + weight_sync_s
