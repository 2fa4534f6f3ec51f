"""Logprobs and entropy computed a chunk of positions at a time are those of the whole logits,
gradients included, at any temperature; a trainer step is the same whatever the chunk."""

from __future__ import annotations

import pytest
import torch

from venusrl.model.architecture import ModelConfig
from venusrl.model.directory import build_model
from venusrl.model.presets import PRESETS
from venusrl.trainer.chunked_logprobs import token_logprobs
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import Trajectory

torch.set_num_threads(1)


def whole_logits(
    hidden: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax((hidden @ head.T) / temperature, dim=-1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprobs_entropy_and_gradients_equal_the_whole_logits(
    chunk: int, temperature: float
) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (37,), generator=g)
    # Weights on both outputs, as the loss has them (advantage-weighted logprob, entropy bonus).
    a = torch.randn(37, generator=g, dtype=torch.float64)
    b = torch.randn(37, generator=g, dtype=torch.float64)

    def run(fn: object) -> list[torch.Tensor]:
        hidden.grad = head.grad = None
        logp, entropy = fn(hidden, head, tokens, temperature)  # type: ignore[operator]
        (a * logp + b * entropy).sum().backward()
        assert hidden.grad is not None and head.grad is not None
        return [logp.detach(), entropy.detach(), hidden.grad, head.grad]

    chunked = run(lambda h, w, t, temp: token_logprobs(h, w, t, temp, chunk_tokens=chunk))
    for got, want in zip(chunked, run(whole_logits), strict=True):
        # In fp64 the same sums in another order: equal far below the 1e-6 asked for.
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10), (got - want).abs().max()


def test_bad_shapes_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="one token per hidden state"):
        token_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[T, d\] and \[V, d\]"):
        token_logprobs(torch.zeros(3, 4), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))


def test_a_trainer_step_is_the_same_whatever_the_logprob_chunk() -> None:
    hf = {**PRESETS["micro"], "model_type": "qwen3", "vocab_size": 64}
    prompt = [5, 6, 7, 8]
    rows = []
    for i, out in enumerate([[20, 21, 22, 23, 24], [30, 31], [40, 41, 42]]):
        t = Trajectory.start(f"t{i}", "g", "p", prompt)
        t.add_model_turn(out, [-4.0] * len(out), [0] * len(out))
        rows.append(t)

    def step(chunk: int) -> tuple[float, float, list[torch.Tensor]]:
        # fp64: what chunking changes is the order of sums; fp32 runs differ by ~1e-6 relative.
        model = build_model(ModelConfig.from_hf(hf), torch.device("cpu"), torch.float64)
        model.init_random(seed=0, std=0.2)
        config = TrainerConfig(lr=1e-2, kl_coef=0.1, entropy_coef=0.01, logprob_chunk_tokens=chunk)
        stats = GRPOTrainer(model, config, temperature=0.8).step(rows, [1.0, -1.0, 0.5])
        # The step leaves its gradients on the parameters (cleared at the next step's start).
        return (
            stats.loss,
            stats.grad_norm,
            [p.grad for p in model.parameters() if p.grad is not None],
        )

    loss, norm, grads = step(3)
    whole_loss, whole_norm, whole_grads = step(10_000)
    assert loss == pytest.approx(whole_loss, rel=1e-10)
    assert norm == pytest.approx(whole_norm, rel=1e-10)
    assert len(grads) == len(whole_grads) > 0
    for a, b in zip(grads, whole_grads, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def test_a_bf16_model_gets_fp32_logprobs_and_bf16_gradients_close_to_the_fp32_ones() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    head = torch.randn(300, 16, generator=g).bfloat16().requires_grad_()
    tokens = torch.randint(0, 300, (40,), generator=g)
    logp, entropy = token_logprobs(hidden, head, tokens, 0.8, chunk_tokens=7)
    assert logp.dtype == entropy.dtype == torch.float32
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad is not None and head.grad is not None
    assert hidden.grad.dtype == head.grad.dtype == torch.bfloat16
    h32 = hidden.detach().float().requires_grad_()
    w32 = head.detach().float().requires_grad_()
    want_logp, want_entropy = whole_logits(h32, w32, tokens, 0.8)
    (want_logp.sum() + want_entropy.sum()).backward()
    # bf16 projections (8 bits of mantissa) against fp32 ones of the same values
    assert torch.allclose(logp, want_logp, atol=0.1)
    assert torch.allclose(entropy, want_entropy, atol=0.1)
    assert h32.grad is not None and w32.grad is not None
    assert torch.allclose(hidden.grad.float(), h32.grad, atol=0.1, rtol=0.05)
    assert torch.allclose(head.grad.float(), w32.grad, atol=0.1, rtol=0.05)


def test_under_bf16_autocast_the_gradients_are_those_of_the_same_autocast_forward() -> None:
    # Backward recomputes the logits: in fp32 against a bf16 forward's log-sum-exp, the softmax
    # it differentiates would not sum to 1 (the one-process bf16 trainer runs under autocast).
    g = torch.Generator().manual_seed(0)
    head = (torch.randn(4000, 64, generator=g) * 0.3).requires_grad_()
    hidden = torch.randn(8, 64, generator=g).requires_grad_()
    tokens = torch.randint(0, 4000, (8,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(hidden, head, tokens, 1.0, chunk_tokens=3)
        z = (hidden @ head.T).float()
        expected = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
    got = torch.autograd.grad(logp.sum(), (hidden, head))
    want = torch.autograd.grad(expected.sum(), (hidden, head))
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-4)
    # The head's gradient is summed in fp32 here, in bf16 by autograd: equal to bf16 rounding.
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2)
