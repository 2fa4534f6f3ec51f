"""GRPO advantages with masking, and the clipped token-level loss."""

from __future__ import annotations

import math

import pytest
import torch

from venusrl.trainer.grpo import group_advantages, informative, policy_loss

torch.set_num_threads(1)


def logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


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
    weights = mask / 4
    adv = torch.ones(6)
    # On-policy: ratio 1, nothing clipped, gradient only through masked-in positions.
    loss, stats = policy_loss(*logprobs_and_entropy(logits, tokens), current, adv, weights)
    loss.backward()
    assert stats.tokens == 4 and stats.clip_fraction == 0 and stats.mean_ratio == pytest.approx(1)
    assert logits.grad is not None
    assert torch.all(logits.grad[mask == 0] == 0) and torch.any(logits.grad[mask == 1] != 0)
    # Stale tokens whose probability rose a lot: the ratio is clipped, no gradient pushes further.
    logits.grad = None
    loss, stats = policy_loss(*logprobs_and_entropy(logits, tokens), current - 1.0, adv, weights)
    loss.backward()
    assert stats.clip_fraction == 1.0
    assert torch.all(logits.grad == 0)  # type: ignore[union-attr]


def test_sequence_mean_weighs_every_trajectory_alike_token_mean_every_token() -> None:
    from venusrl.trainer.grpo import row_weights

    assert row_weights([2, 6], "token_mean") == pytest.approx([1 / 8, 1 / 8])
    seq = row_weights([2, 6], "seq_mean")
    assert seq == pytest.approx([1 / 4, 1 / 12])
    assert 2 * seq[0] == pytest.approx(6 * seq[1])  # each trajectory's tokens sum to 1/2
    assert row_weights([0, 4], "seq_mean") == [0.0, 0.25]


def test_the_kl_penalty_is_zero_at_the_reference_and_pulls_back_towards_it() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (4,))
    current = torch.log_softmax(logits.detach(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    weights, zero_adv = torch.full((4,), 0.25), torch.zeros(4)
    _, at_ref = policy_loss(
        *logprobs_and_entropy(logits, tokens), current, zero_adv, weights, 0.2, 0.0, current, 1.0
    )
    assert at_ref.kl == pytest.approx(0.0, abs=1e-6)
    # The reference gave these tokens more probability: the penalty's gradient raises them.
    loss, away = policy_loss(
        *logprobs_and_entropy(logits, tokens),
        current,
        zero_adv,
        weights,
        0.2,
        0.0,
        current + 0.5,
        1.0,
    )
    loss.backward()
    assert away.kl > 0
    assert logits.grad is not None
    assert all(float(logits.grad[i, tokens[i]]) < 0 for i in range(4))  # descent raises them


def test_far_off_logprobs_at_tokens_without_weight_leave_the_loss_finite() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (4,))
    current = torch.log_softmax(logits.detach(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    weights = torch.tensor([0.0, 0.5, 0.5, 0.0])  # a prompt token first, padding last
    # A prompt token the reference finds far likelier than the policy does, and a behaviour
    # logprob far below the current one where nothing was sampled: exp() of either overflows.
    reference, behaviour = current.clone(), current.clone()
    reference[0] += 200.0
    behaviour[3] -= 200.0
    loss, stats = policy_loss(
        *logprobs_and_entropy(logits, tokens),
        behaviour,
        torch.ones(4),
        weights,
        0.2,
        0.0,
        reference,
        0.1,
    )
    loss.backward()
    assert torch.isfinite(loss) and stats.kl == pytest.approx(0.0, abs=1e-6)
    assert logits.grad is not None and torch.all(torch.isfinite(logits.grad))
    assert torch.all(logits.grad[[0, 3]] == 0) and torch.any(logits.grad[1:3] != 0)


def _loss_and_grad(
    off_policy: str, behaviour_shift: torch.Tensor, cap: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The loss and its gradient on fixed logits, with the sampler's logprobs the trainer's
    shifted by `behaviour_shift` (0: they agree)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (6,))
    logp, entropy = logprobs_and_entropy(logits, tokens)
    proximal = logp.detach()
    weights = torch.tensor([0, 1, 1, 0, 1, 1]) / 4
    adv = torch.tensor([0.0, 1.0, -1.0, 0.0, 2.0, -0.5])
    loss, stats = policy_loss(
        logp, entropy, proximal - behaviour_shift, adv, weights,
        proximal_logprobs=proximal, off_policy=off_policy, is_cap=cap,  # type: ignore[arg-type]
    )  # fmt: skip
    loss.backward()
    assert logits.grad is not None
    return loss.detach(), logits.grad, stats


@pytest.mark.parametrize("off_policy", ["tis", "mis", "decoupled"])
def test_each_off_policy_correction_is_the_plain_loss_when_sampler_and_trainer_agree(
    off_policy: str,
) -> None:
    agree = torch.zeros(6)
    plain_loss, plain_grad, _ = _loss_and_grad("ppo", agree)
    loss, grad, stats = _loss_and_grad(off_policy, agree)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert stats.is_weight == 1 and stats.is_capped == 0 and stats.sampler_kl == 0  # type: ignore[attr-defined]


def test_tis_truncates_mis_masks_and_decoupled_keeps_the_importance_weight() -> None:
    # The trainer finds token 1 e^2 (7.4x) likelier than the sampler did, token 2 as likely.
    shift = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    on_policy_grad = _loss_and_grad("ppo", torch.zeros(6))[1]
    for off_policy, token_1_weight in [("tis", 2.0), ("mis", 0.0), ("decoupled", math.exp(2))]:
        _, grad, stats = _loss_and_grad(off_policy, shift, cap=2.0)
        # The ratio to the trainer's own policy is 1: each token's gradient is the on-policy
        # one times its importance weight.
        assert torch.allclose(grad[1], token_1_weight * on_policy_grad[1], atol=1e-6)
        assert torch.allclose(grad[[0, 2, 3, 4, 5]], on_policy_grad[[0, 2, 3, 4, 5]], atol=1e-7)
        assert stats.is_capped == pytest.approx(1 / 4)  # type: ignore[attr-defined]
        assert stats.is_weight == pytest.approx((3 + token_1_weight) / 4)  # type: ignore[attr-defined]
        assert stats.sampler_kl == pytest.approx((math.exp(-2) + 2 - 1) / 4)  # type: ignore[attr-defined]
    # PPO takes the ratio to the sampler: e^2 is far past the clip, so token 1 has no gradient.
    _, grad, stats = _loss_and_grad("ppo", shift)
    assert torch.all(grad[1] == 0) and stats.is_weight == 1  # type: ignore[attr-defined]


def test_a_correction_without_the_trainer_logprobs_is_refused() -> None:
    logp = torch.zeros(2)
    with pytest.raises(ValueError, match="off_policy=tis needs"):
        policy_loss(logp, logp, logp, logp, torch.ones(2), off_policy="tis")


def test_a_group_whose_rewards_all_agree_or_with_one_scored_member_teaches_nothing() -> None:
    assert informative([1.0, 0.0, 1.0]) and informative([0.5, None, 0.25])
    assert not informative([1.0, 1.0, 1.0]) and not informative([0.0, 0.0])
    assert not informative([1.0, None]) and not informative([None, None])
