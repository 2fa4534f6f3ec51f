"""Token sampling for one engine step, batched over rows.

Greedy rows take the argmax. Sampled rows draw by inverse CDF: one uniform per row, placed in the
cumulative distribution of its (temperature-scaled, top-k/top-p truncated) probabilities. The
uniform is a counter-based hash of the request's seed and the index of the token it samples
(SplitMix64), not a draw from a stateful generator, so a seeded request gives the same tokens
whatever else is in the batch and whenever it runs (preempted and resumed too), and all rows are
drawn in a few tensor operations. A per-row generator loop took a third of a decode step of
the CPU example's model at 64 rows. Rows that ask for top logprobs get the top-k of the same
log-softmax their sampled token's logprob comes from; a step in which no row asks computes none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from venusrl.types import SamplingParams, TopLogprobs

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014) over uint64 values, wrapping."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """One uniform in (0, 1] per (seed, counter), independent of every other pair."""
    keys = _splitmix64(np.asarray(seeds, dtype=np.uint64))
    with np.errstate(over="ignore"):
        bits = _splitmix64(keys + np.asarray(counters, dtype=np.uint64))
    return ((bits >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    counters: Sequence[int],
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """logits: [rows, vocab] fp32; `seeds[i]` is row i's sampling stream (None when greedy),
    `counters[i]` the index of the token it samples (its tokens so far). Returns the token ids,
    their logprobs under the temperature-scaled distribution, and for each row whose params ask
    for `top_logprobs` that many most likely tokens of that distribution (None for the others)."""
    if all(p.greedy for p in params):  # the common RL-eval case: no [rows, vocab] softmax
        tokens = logits.argmax(dim=-1)
        norm = torch.logsumexp(logits, dim=-1)
        chosen = logits.gather(1, tokens[:, None])[:, 0] - norm
        # log_softmax's top-k is the logits' top-k less the row's normaliser.
        top = _top_logprobs(logits, params, norm)
        return tokens.tolist(), chosen.tolist(), top
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    logprobs = torch.log_softmax(logits / temps.to(logits.device)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    probs = logprobs[drawn].exp()
    for i, row in enumerate(drawn):
        p = params[row]
        if p.top_k > 0 or p.top_p < 1.0:
            probs[i] = _truncate(probs[i], p.top_k, p.top_p)
    # float64 sums: a float32 CDF over a large vocabulary drifts by more than a rare token's mass
    cdf = probs.double().cumsum(dim=-1)
    u = torch.from_numpy(
        uniforms([seeds[row] or 0 for row in drawn], [counters[row] for row in drawn])
    ).to(cdf.device)
    # The first token whose CDF reaches u * total: u > 0, so it has positive probability.
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[1] - 1)
    tokens[drawn] = picked[:, 0].to(tokens.dtype)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist(), _top_logprobs(logprobs, params)


def _top_logprobs(
    scores: torch.Tensor, params: Sequence[SamplingParams], norm: torch.Tensor | None = None
) -> list[TopLogprobs | None]:
    """The `top_logprobs` best of each asking row of `scores` ([rows, vocab] logprobs, or logits
    less `norm`, their rows' logsumexp), before top-k/top-p truncation as the sampled token's."""
    asking = [row for row, p in enumerate(params) if p.top_logprobs > 0]
    top: list[TopLogprobs | None] = [None] * len(params)
    if not asking:
        return top
    k = min(max(params[row].top_logprobs for row in asking), scores.shape[1])
    values, ids = scores[asking].topk(k, dim=-1)  # one top-k for the rows, cut to each's own k
    if norm is not None:
        values -= norm[asking][:, None]
    for row, row_ids, row_values in zip(asking, ids.tolist(), values.tolist(), strict=True):
        n = params[row].top_logprobs
        top[row] = list(zip(row_ids[:n], row_values[:n], strict=True))
    return top


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the top-k and the top-p nucleus (the top token always stays)."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep a token while the mass strictly before it is below top_p.
        before = sorted_probs.cumsum(0) - sorted_probs
        keep &= before < top_p
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out
