"""The sampler draws from the distribution it reports, and a seed fixes each row's draws alone;
rows that ask for top logprobs get that distribution's most likely tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from venusrl.engine.sampler import sample, uniforms
from venusrl.types import SamplingParams

torch.set_num_threads(1)


def test_sampled_tokens_follow_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    params = SamplingParams(temperature=0.7, max_tokens=1)
    n = 20_000
    tokens, logprobs, _ = sample(logits.expand(n, -1), [params] * n, [7] * n, list(range(n)))
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
    tokens, _, _ = sample(logits, rows, list(range(2_000)), [0] * 2_000)
    assert set(tokens[0::2]) == {0, 1}
    assert set(tokens[1::2]) <= {0, 1} and len(set(tokens[1::2])) == 2


def test_a_rows_draw_depends_only_on_its_seed_and_counter() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, max_tokens=1)] * 6
    seeds, counters = [11, 12, 13, 14, 15, 16], [0, 3, 1, 4, 1, 5]
    together, _, _ = sample(logits, params, seeds, counters)
    alone = [sample(logits[i : i + 1], params[:1], seeds[i : i + 1], counters[i : i + 1])[0][0]
             for i in range(6)]  # fmt: skip
    assert together == alone
    u = uniforms([1, 1, 2], [0, 1, 0])
    assert len(set(u.tolist())) == 3 and ((u > 0) & (u <= 1)).all()


def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_sampled_from() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    params = [
        SamplingParams(temperature=0, top_logprobs=5),  # greedy: raw logits
        SamplingParams(temperature=0.7, top_k=2, top_logprobs=20),  # before the top-k cut
        SamplingParams(temperature=1.3, top_logprobs=0),
        SamplingParams(temperature=0, top_logprobs=1),
    ]
    seeds, counters = [None, 3, 4, None], [0, 0, 0, 0]
    tokens, logprobs, top = sample(logits, params, seeds, counters)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0])[:, None]
    expected = torch.log_softmax(logits / temps, dim=-1)
    assert top[2] is None
    for row in (0, 1, 3):
        alternatives = top[row]
        assert alternatives is not None
        values, ids = expected[row].topk(params[row].top_logprobs)
        assert [t for t, _ in alternatives] == ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in alternatives]), values)
    assert top[0] is not None and top[0][0] == (tokens[0], logprobs[0])  # greedy takes the best
    # Asking changes neither the tokens nor their logprobs.
    plain = [SamplingParams(temperature=p.temperature, top_k=p.top_k) for p in params]
    assert sample(logits, plain, seeds, counters)[:2] == (tokens, logprobs)
    # All greedy rows take the path without a softmax; their alternatives agree with it.
    greedy_tokens, _, greedy_top = sample(logits[[0, 3]], params[0::3], [None] * 2, [0] * 2)
    assert greedy_tokens == [tokens[0], tokens[3]]
    for fast, slow in zip(greedy_top, (top[0], top[3]), strict=True):
        assert fast is not None and slow is not None
        assert [t for t, _ in fast] == [t for t, _ in slow]
        assert [lp for _, lp in fast] == pytest.approx([lp for _, lp in slow], abs=1e-5)


def test_a_vocabulary_smaller_than_the_count_asked_gives_all_of_it() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    _, _, top = sample(logits, [SamplingParams(temperature=0, top_logprobs=20)], [None], [0])
    assert top[0] is not None and [t for t, _ in top[0]] == [1, 2, 0]


@pytest.mark.parametrize("count", [-1, 21])
def test_top_logprobs_outside_0_to_20_is_refused_by_name(count: int) -> None:
    with pytest.raises(ValueError, match="top_logprobs must be in \\[0, 20\\]"):
        SamplingParams(top_logprobs=count)


def _numpy_uniforms(seeds: list[int], counters: list[int]) -> np.ndarray:
    """The uniforms as the host computed them before sampling moved to the device."""

    def mix(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = x + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        bits = mix(mix(np.asarray(seeds, dtype=np.uint64)) + np.asarray(counters, np.uint64))
    return ((bits >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**20)), min_size=1, max_size=8)
)
def test_device_uniforms_match_the_host_splitmix64_bit_for_bit(
    pairs: list[tuple[int, int]],
) -> None:
    seeds, counters = [s for s, _ in pairs], [c for _, c in pairs]
    assert uniforms(seeds, counters).tolist() == _numpy_uniforms(seeds, counters).tolist()


def _reference_sample(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row the way the sampler drew before it ran on the device: sort, fp32 nucleus cut, and
    a float64 cumsum over the whole vocabulary in vocabulary order."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        keep &= sorted_probs.cumsum(0) - sorted_probs < p.top_p
    keep[0] = True
    cut = torch.zeros_like(probs)
    cut[order[keep]] = sorted_probs[keep]
    cdf = cut.double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64)))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 3000),
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 1.7]),
            st.sampled_from([0, 1, 5, 40]),
            st.sampled_from([1.0, 0.9, 0.3]),
            st.integers(0, 2**63 - 1),
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 2**16),
)
def test_seeded_draws_are_those_of_a_float64_cumsum_over_the_whole_vocabulary(
    vocab: int, rows: list[tuple[float, int, float, int]], data_seed: int
) -> None:
    """Block-wise inverse CDF, batched truncation and device uniforms pick, for every row and
    whatever the batch, the token the host's full-vocabulary float64 CDF picked."""
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(data_seed)) * 4
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p, _ in rows]
    seeds = [None if p.greedy else s for p, (*_, s) in zip(params, rows, strict=True)]
    counters = list(range(len(rows)))
    tokens, logprobs, _ = sample(logits, params, seeds, counters)
    u = _numpy_uniforms([s or 0 for s in seeds], counters)
    for row, p in enumerate(params):
        expected = (
            int(logits[row].argmax())
            if p.greedy
            else _reference_sample(logits[row], p, float(u[row]))
        )
        assert tokens[row] == expected
        temp = 1.0 if p.greedy else p.temperature
        reference_logprob = torch.log_softmax(logits[row] / temp, -1)[expected]
        assert logprobs[row] == pytest.approx(float(reference_logprob), abs=1e-5)
