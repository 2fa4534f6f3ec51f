"""The least rollout GPU time a trained sample needs, whatever schedules it.

Where the engines are never idle, a step cannot be shorter than the GPU work of the samples it
trains divided among the engines, and no scheduler can take that work away: every generated token
reads the KV of the tokens before it, every prompt and observation is prefilled once. A schedule
only adds to it (KV computed again after an eviction, copies to and from the host tier, engines
idle while agents wait on tools), and batching saves no more than the fewest iterations below
allow. So `floor_step_s` is a lower bound on a throughput-bound step, the complement of the
`--unloaded` run (`benchmarks/sim_scenarios.py`), which bounds a latency-bound one by the
batches' critical path: a policy's step over its floor is the most any schedule of its engines
could gain where rollout sets the pace.

Counted here, per trajectory, from its plan and the turns it ran: the decode of each action after
its context (its first token sampled by the prefill before it, as the engine does); the prefill
of each observation after the context before it; its group's prompt once, shared by its members
(the radix cache's best). Left out, so the floor stays below what any schedule reaches: the
attempts the platform failed, and the context lost to a cut.

How many decode iterations the work takes is where batching counts, and two things bound it from
below whatever the schedule: an iteration decodes at most `max_batch` requests, and the KV it
reads must all be on one engine's device at once. Reads beyond a group's prompt are each
trajectory's own KV (the prompt may be shared, so it is not counted against the device), so the
iterations are at least the larger of the tokens over `max_batch` and those reads over the
device's KV (on swe-long's long contexts the second: the floor 5-6 % higher than with the first).
"""

from __future__ import annotations

from dataclasses import dataclass

from venusrl.sim.cost_model import CostModel
from venusrl.workloads import TrajectoryPlan


@dataclass(frozen=True)
class Work:
    """The GPU work of some trajectories, in the terms that add up across them."""

    prefill_s: float = 0.0  # prompts (a group's once) and observations, each prefilled once
    tokens: int = 0  # decoded
    reads: float = 0.0  # KV tokens the decodes read
    own_reads: float = 0.0  # of them, beyond the group's prompt: never shared on a device

    def __add__(self, other: Work) -> Work:
        return Work(
            self.prefill_s + other.prefill_s,
            self.tokens + other.tokens,
            self.reads + other.reads,
            self.own_reads + other.own_reads,
        )

    def gpu_s(self, cost: CostModel, max_batch: int) -> float:
        """Its least GPU time: the prefills, and the decodes in as few iterations as the batch
        limit and the device's KV allow."""
        iterations = max(self.tokens / max_batch, self.own_reads / cost.kv_capacity_tokens)
        return self.prefill_s + cost.decode_s(iterations, self.tokens, self.reads)


def trajectory_work(
    plan: TrajectoryPlan, turns: int, template_tokens: int, group_size: int, cost: CostModel
) -> Work:
    """The work of the first `turns` turns of `plan` (the actions decoded, the observations
    between them prefilled), and its share of its group's prompt."""
    prefill_s = cost.prefill_s(plan.prompt_tokens, 0) / group_size
    tokens, reads, own_reads = 0, 0.0, 0.0
    context = plan.prompt_tokens
    for i, turn in enumerate(plan.turns[:turns]):
        # The prefill before an action samples its first token; each later one is decoded
        # reading the context and the action's tokens before it.
        n = max(turn.action_tokens - 1, 0)
        read = n * context + n * (n - 1) / 2
        tokens += n
        reads += read
        own_reads += read - n * plan.prompt_tokens
        context += turn.action_tokens
        if i < turns - 1:  # the observation the next turn reads
            observed = turn.observation_tokens + template_tokens
            prefill_s += cost.prefill_s(observed, context)
            context += observed
    return Work(prefill_s, tokens, reads, own_reads)


def floor_step_s(gpu_s: float, steps: int, engines: int, weight_sync_s: float) -> float:
    """The step time if `engines` did nothing but the `gpu_s` GPU seconds that `steps` trained
    batches need, each step also pausing them `weight_sync_s` to load new weights."""
    return gpu_s / (steps * engines) + weight_sync_s
