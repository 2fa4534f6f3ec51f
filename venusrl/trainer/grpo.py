"""GRPO: group-normalised advantages and the clipped, token-level policy loss.

Advantages (DeepSeekMath's GRPO): within one group of K trajectories of the same prompt,
A_i = (r_i - mean(r)) / (std(r) + eps). Members that failed for infrastructure reasons carry no
reward (None): they are masked out of the statistics and get no advantage, never a reward of 0
that would punish the policy for the platform's fault. A group with fewer than two scored members
or no spread teaches nothing: all its advantages are 0.

Loss (PPO-clip against the behaviour policy, which the engine recorded per token):
ratio_t = exp(logp_t - logp_behaviour_t) corrects for tokens produced by older weights (bounded
staleness); the objective min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A) is averaged over the
model's tokens only (the mask excludes prompt and observation tokens), optionally with an entropy
bonus: without it a multi-turn policy tends to collapse to one fixed action sequence
(MEASURED.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(rewards: Sequence[float | None], eps: float = 1e-6) -> list[float | None]:
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2:
        return [None if r is None else 0.0 for r in rewards]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
    if std < eps:
        return [None if r is None else 0.0 for r in rewards]
    return [None if r is None else (r - mean) / (std + eps) for r in rewards]


@dataclass(frozen=True)
class LossStats:
    loss: float
    clip_fraction: float
    mean_ratio: float
    entropy: float
    tokens: int


def policy_loss(
    logits: torch.Tensor,  # [T, V] current logits at the positions that predicted `tokens`
    tokens: torch.Tensor,  # [T] the tokens that were sampled
    behaviour_logprobs: torch.Tensor,  # [T] logprobs the engine recorded when sampling them
    advantages: torch.Tensor,  # [T] the trajectory's advantage on each of its tokens
    mask: torch.Tensor,  # [T] 1 for model tokens, 0 for prompt and observation tokens
    clip_eps: float = 0.2,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    ratio = torch.exp(logp - behaviour_logprobs)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.float()
    n = m.sum().clamp(min=1)
    loss = -((objective + entropy_coef * entropy) * m).sum() / n
    with torch.no_grad():
        stats = LossStats(
            loss=float(loss),
            clip_fraction=float((((ratio - clipped).abs() > 1e-6).float() * m).sum() / n),
            mean_ratio=float((ratio * m).sum() / n),
            entropy=float((entropy * m).sum() / n),
            tokens=int(m.sum()),
        )
    return loss, stats
