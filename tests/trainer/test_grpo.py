"""GRPO advantages with masking, and the clipped token-level loss."""

from __future__ import annotations

import pytest
import torch

from venusrl.trainer.grpo import group_advantages, policy_loss

torch.set_num_threads(1)


def test_advantages_are_group_normalised() -> None:
    adv = group_advantages([1.0, 0.0, 1.0, 0.0])
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_infrastructure_failures_are_masked_out_not_scored_zero() -> None:
    adv = group_advantages([1.0, None, 0.0, None])
    assert adv[1] is None and adv[3] is None
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[2] == pytest.approx(-1.0, abs=1e-5)
    # Scoring the failures as 0 would have made the successful member look even better.
    assert group_advantages([1.0, 0.0, 0.0, 0.0])[0] > adv[0]  # type: ignore[operator]


def test_a_group_without_spread_or_with_one_scored_member_teaches_nothing() -> None:
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, None, None]) == [0.0, None, None]


def test_loss_counts_model_tokens_only_and_clips_the_ratio() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (6,))
    current = torch.log_softmax(logits.detach(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    mask = torch.tensor([0, 1, 1, 0, 1, 1])
    adv = torch.ones(6)
    # On-policy: ratio 1, nothing clipped, gradient only through masked-in positions.
    loss, stats = policy_loss(logits, tokens, current, adv, mask)
    loss.backward()
    assert stats.tokens == 4 and stats.clip_fraction == 0 and stats.mean_ratio == pytest.approx(1)
    assert logits.grad is not None
    assert torch.all(logits.grad[mask == 0] == 0) and torch.any(logits.grad[mask == 1] != 0)
    # Stale tokens whose probability rose a lot: the ratio is clipped, no gradient pushes further.
    logits.grad = None
    loss, stats = policy_loss(logits, tokens, current - 1.0, adv, mask)
    loss.backward()
    assert stats.clip_fraction == 1.0
    assert torch.all(logits.grad == 0)  # type: ignore[union-attr]
