"""GRPO: group-normalised advantages and the clipped, token-level policy loss.

Advantages (DeepSeekMath's GRPO): within one group of K trajectories of the same prompt,
A_i = (r_i - mean(r)) / (std(r) + eps). Members that failed for infrastructure reasons carry no
reward (None): they are masked out of the statistics and get no advantage, never a reward of 0
that would punish the policy for the platform's fault. A group with fewer than two scored members
or no spread teaches nothing: all its advantages are 0.

Loss (PPO-clip against the behaviour policy, which the engine recorded per token):
ratio_t = exp(logp_t - logp_behaviour_t) corrects for tokens produced by older weights (bounded
staleness); the objective min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A) is summed over the
model's tokens only, each with a weight (0 for prompt and observation tokens; the trainer chooses
the weights, see `LossAggregation`), optionally with an entropy bonus: without it a multi-turn
policy tends to collapse to one fixed action sequence (MEASURED.md), and optionally with a KL
penalty to a frozen reference policy (the k3 estimator of DeepSeekMath's GRPO on the sampled
tokens, exp(ref - logp) - (ref - logp) - 1, unbiased and never negative): it keeps the tokens the
reward says nothing about (the format every episode writes) where the reference had them while
the advantages move the decisions.

Off-policy corrections (`OffPolicy`, `trainer.off_policy`): with the trainer's own logprobs
before the step (the proximal policy, p) beside the sampler's (b), the ratio is taken to p and
each token's objective is weighed by w = exp(p - b), truncated, masked or whole; the statistics
report w and the sampler's k3 distance to the trainer, exp(b - p) - (b - p) - 1, in every mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from venusrl.trainer.config import LossAggregation, OffPolicy


def group_advantages(rewards: Sequence[float | None], eps: float = 1e-6) -> list[float | None]:
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2:
        return [None if r is None else 0.0 for r in rewards]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
    if std < eps:
        return [None if r is None else 0.0 for r in rewards]
    return [None if r is None else (r - mean) / (std + eps) for r in rewards]


def informative(rewards: Sequence[float | None], eps: float = 1e-6) -> bool:
    """Whether a group's rewards teach GRPO anything: two scored members at least, not all
    alike (else every advantage is 0, `group_advantages`: DAPO's dynamic sampling drops it)."""
    return any(a for a in group_advantages(rewards, eps) if a is not None)


def row_weights(model_tokens: Sequence[int], aggregation: LossAggregation) -> list[float]:
    """The loss weight of each model token of each row (trajectory), summing to 1 over the batch."""
    if aggregation == "token_mean":
        total = sum(model_tokens)
        return [1.0 / total if total else 0.0 for _ in model_tokens]
    rows = sum(1 for n in model_tokens if n)
    return [1.0 / (rows * n) if n else 0.0 for n in model_tokens]


@dataclass(frozen=True)
class LossStats:
    loss: float
    clip_fraction: float
    mean_ratio: float
    entropy: float
    kl: float  # mean k3 estimate to the reference; 0 without one
    tokens: int
    is_weight: float  # mean importance weight trainer / sampler, as applied (1 under ppo)
    is_capped: float  # fraction of tokens whose weight passed `is_cap`
    sampler_kl: float  # mean k3 estimate of the sampler's distance to the trainer's policy


def policy_loss(
    logp: torch.Tensor,  # [T] current logprobs of `tokens` (trainer/chunked_logprobs.py)
    entropy: torch.Tensor,  # [T] current entropy at the positions that predicted them
    behaviour_logprobs: torch.Tensor,  # [T] logprobs the engine recorded when sampling them
    advantages: torch.Tensor,  # [T] the trajectory's advantage on each of its tokens
    weights: torch.Tensor,  # [T] each token's weight; 0 for prompt and observation tokens
    clip_eps: float = 0.2,
    entropy_coef: float = 0.0,
    reference_logprobs: torch.Tensor | None = None,  # [T] under the reference policy
    kl_coef: float = 0.0,
    proximal_logprobs: torch.Tensor | None = None,  # [T] the trainer's, before this step
    off_policy: OffPolicy = "ppo",
    is_cap: float = 2.0,
) -> tuple[torch.Tensor, LossStats]:
    """The weighted sum of the negated per-token objective (the caller normalises it); the
    statistics are plain means over the tokens with a weight. Every correction but `ppo` needs
    `proximal_logprobs`; given, they also measure the sampler's distance in every mode."""
    # Log ratios are taken as 0 where a token has no weight (prompt, observation, padding):
    # exp() of a large one there would be inf, and inf x 0 a NaN loss and NaN gradients.
    trained = weights > 0
    if off_policy != "ppo" and proximal_logprobs is None:
        raise ValueError(f"off_policy={off_policy} needs the trainer's proximal logprobs")
    anchor = behaviour_logprobs if off_policy == "ppo" else proximal_logprobs
    assert anchor is not None
    ratio = torch.exp(torch.where(trained, logp - anchor, 0.0))
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    is_weight, capped, sampler_kl = _importance(
        proximal_logprobs, behaviour_logprobs, trained, off_policy, is_cap
    )
    per_token = is_weight * objective + entropy_coef * entropy
    kl = torch.zeros_like(logp)
    if reference_logprobs is not None:
        log_ratio = torch.where(trained, reference_logprobs - logp, 0.0)
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = per_token - kl_coef * kl
    loss = -(per_token * weights).sum()
    m = trained.float()
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        stats = LossStats(
            loss=float(loss),
            clip_fraction=float((((ratio - clipped).abs() > 1e-6).float() * m).sum() / n),
            mean_ratio=float((ratio * m).sum() / n),
            entropy=float((entropy * m).sum() / n),
            kl=float((kl * m).sum() / n),
            tokens=int(m.sum()),
            is_weight=float((is_weight * m).sum() / n),
            is_capped=float((capped.float() * m).sum() / n),
            sampler_kl=float((sampler_kl * m).sum() / n),
        )
    return loss, stats


def _importance(
    proximal: torch.Tensor | None, behaviour: torch.Tensor, trained: torch.Tensor,
    off_policy: OffPolicy, cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each token's importance weight as the correction applies it (no gradient), whether its
    raw weight passed `cap`, and the sampler's k3 distance to the trainer (0 without `proximal`)."""
    if proximal is None:
        ones = torch.ones_like(behaviour)
        return ones, torch.zeros_like(trained), torch.zeros_like(behaviour)
    with torch.no_grad():
        log_w = torch.where(trained, proximal - behaviour, 0.0)
        w = torch.exp(log_w)
        capped = w > cap
        sampler_kl = torch.exp(-log_w) + log_w - 1
        if off_policy == "tis":
            w = w.clamp(max=cap)
        elif off_policy == "mis":
            w = torch.where(capped, 0.0, w)
        elif off_policy == "ppo":
            w = torch.ones_like(w)
    return w, capped, sampler_kl
