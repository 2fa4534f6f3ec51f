"""The sampler draws from the distribution it reports, and a seed fixes each row's draws alone."""

from __future__ import annotations

import torch

from venusrl.engine.request import SamplingParams
from venusrl.engine.sampler import sample, uniforms

torch.set_num_threads(1)


def test_sampled_tokens_follow_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    params = SamplingParams(temperature=0.7, max_tokens=1)
    n = 20_000
    tokens, logprobs = sample(logits.expand(n, -1), [params] * n, [7] * n, list(range(n)))
    expected = torch.softmax(logits[0] / 0.7, -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    # 5 standard errors of a binomial share, at most ~0.017 here
    assert torch.all((counts - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-9)
    assert counts[4] == 0  # a token of probability ~1e-19 is never drawn
    reported = torch.tensor(logprobs)
    assert torch.allclose(reported, expected.log()[torch.tensor(tokens)], atol=1e-5)


def test_top_k_and_top_p_rows_draw_only_inside_their_cut() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0]]).expand(2_000, -1)
    k2 = SamplingParams(temperature=1.0, top_k=2, max_tokens=1)
    p = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=1)
    rows = [k2, p] * 1_000
    tokens, _ = sample(logits, rows, list(range(2_000)), [0] * 2_000)
    assert set(tokens[0::2]) == {0, 1}
    assert set(tokens[1::2]) <= {0, 1} and len(set(tokens[1::2])) == 2


def test_a_rows_draw_depends_only_on_its_seed_and_counter() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, max_tokens=1)] * 6
    seeds, counters = [11, 12, 13, 14, 15, 16], [0, 3, 1, 4, 1, 5]
    together, _ = sample(logits, params, seeds, counters)
    alone = [sample(logits[i : i + 1], params[:1], seeds[i : i + 1], counters[i : i + 1])[0][0]
             for i in range(6)]  # fmt: skip
    assert together == alone
    u = uniforms([1, 1, 2], [0, 1, 0])
    assert len(set(u.tolist())) == 3 and ((u > 0) & (u <= 1)).all()
