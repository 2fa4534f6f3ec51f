"""Token sampling for one engine step, batched over rows, on the logits' device.

Greedy rows take the argmax. Sampled rows draw by inverse CDF: one uniform per row, placed in the
cumulative distribution of its (temperature-scaled, top-k/top-p truncated) probabilities. The
uniform is a counter-based hash of the request's seed and the index of the token it samples
(SplitMix64, in integer tensor ops), not a draw from a stateful generator, so a seeded request
gives the same tokens whatever else is in the batch and whenever it runs (preempted and resumed
too). Everything stays on the device until one copy brings the step's token ids, logprobs and
requested top logprobs to the host together: one synchronisation a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from venusrl.engine.uploads import to_device
from venusrl.types import SamplingParams, TopLogprobs


def _int64(bits: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return bits - 2**64 if bits >= 2**63 else bits


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
# The inverse CDF finds a row's block of this many tokens, then its token inside the block.
CDF_BLOCK = 1024


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits (`>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014) over uint64 bits in int64 tensors:
    two's-complement adds and multiplies wrap to the same low 64 bits as unsigned ones."""
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def uniforms(
    seeds: Sequence[int] | torch.Tensor, counters: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """One float64 uniform in (0, 1] per (seed, counter), independent of every other pair; on
    the device of `seeds` when it is a tensor of int64 bits (seeds >= 2**63 wrapped)."""
    if not isinstance(seeds, torch.Tensor):
        seeds = torch.tensor([_int64(s) for s in seeds], dtype=torch.int64)
    if not isinstance(counters, torch.Tensor):
        counters = torch.tensor(list(counters), dtype=torch.int64, device=seeds.device)
    bits = _splitmix64(_splitmix64(seeds) + counters)
    # The top 53 bits, exact in a float64.
    return (_shift_right(bits, 11).double() + 1.0) * 2.0**-53


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
        return _to_host(tokens, chosen, logits, norm, params)
    dev = logits.device
    # Per-row parameters in two host tensors, each one copy (pinned, asynchronous on CUDA).
    floats = to_device(
        torch.tensor(
            [
                [1.0 if p.greedy else p.temperature, p.top_p if p.top_p < 1.0 else 2.0]
                for p in params
            ]
        ),
        dev,
    )
    ints = to_device(
        torch.tensor(
            [
                [_int64(s or 0), c, p.top_k, p.greedy]
                for p, s, c in zip(params, seeds, counters, strict=True)
            ],
            dtype=torch.int64,
        ),
        dev,
    )
    temps, top_p = floats.T
    seed_bits, counter, top_k, greedy = ints.T
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = logprobs.exp()
    truncating = [p for p in params if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
    if truncating:
        # A nucleus without a top-k may reach any depth: then the whole vocabulary is sorted.
        bounded = all(p.top_k > 0 for p in truncating)
        candidates = max(p.top_k for p in truncating) if bounded else probs.shape[1]
        candidates = min(candidates, probs.shape[1])
        any_top_k = any(p.top_k > 0 for p in truncating)
        probs = _truncate(probs, top_k, top_p, candidates, any_top_k)
    drawn = _inverse_cdf(probs, uniforms(seed_bits, counter))
    tokens = torch.where(greedy.bool(), logits.argmax(dim=-1), drawn)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return _to_host(tokens, chosen, logprobs, None, params)


def _truncate(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    candidates: int,
    any_top_k: bool,
) -> torch.Tensor:
    """Zero out each row's tokens outside its top-k and its top-p nucleus (the top token always
    stays), looking only at the `candidates` most likely tokens of every row (enough: the largest
    top-k when every truncating row has one). The nucleus is cut on an fp32 cumulative sum over
    the sorted candidates, largest first, as before this ran on the device: a token whose mass
    before it is within fp32 rounding (~1e-7) of top_p may fall on either side. Rows with
    top_k <= 0 and top_p >= 1 (passed as 2.0) keep all their tokens."""
    if candidates < probs.shape[1]:
        values, ids = probs.topk(candidates, dim=-1)  # sorted, largest first
    else:  # a full sort: measured faster than a top-k of the whole vocabulary on a CPU
        values, ids = probs.sort(dim=-1, descending=True)
    before = values.cumsum(dim=-1).sub_(values)  # the mass strictly before each candidate
    keep = before < top_p[:, None]
    if any_top_k:
        rank = torch.arange(candidates, device=probs.device)
        keep &= (top_k[:, None] <= 0) | (rank[None, :] < top_k[:, None])
    keep[:, 0] = True
    truncated = torch.zeros_like(probs).scatter_(1, ids, values.masked_fill_(~keep, 0.0))
    untouched = (top_k <= 0) & (top_p > 1.0)
    return torch.where(untouched[:, None], probs, truncated)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row the first token whose cumulative probability (in vocabulary order) reaches
    u * total, as one float64 cumsum over the whole vocabulary would find it (a float32 CDF over
    150K tokens drifts by more than a rare token's mass), with no such scan: float64 sums of
    blocks of CDF_BLOCK tokens, a scan over those sums to find the block, and one over the
    block's tokens. u > 0, so the token has positive probability."""
    rows, vocab = probs.shape
    blocks = F.pad(probs, (0, -vocab % CDF_BLOCK)).view(rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [rows, vocab / BLOCK]
    target = (u * block_cdf[:, -1])[:, None]
    block = torch.searchsorted(block_cdf, target).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block[:, :, None].expand(rows, 1, CDF_BLOCK))[:, 0]
    # Rounding can leave the block's own sum short of what the block search assumed: then the
    # draw is the block's last token of positive probability.
    last = torch.where(inside > 0, torch.arange(CDF_BLOCK, device=probs.device), -1).amax(-1)
    index = torch.searchsorted(inside.double().cumsum(dim=-1), target - before)[:, 0]
    return block[:, 0] * CDF_BLOCK + torch.minimum(index, last)


def _to_host(
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    scores: torch.Tensor,
    norm: torch.Tensor | None,
    params: Sequence[SamplingParams],
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """The step's one device-to-host copy: token ids (exact in float64), their logprobs and the
    top logprobs asked for (from `scores`, [rows, vocab] logprobs, or logits less `norm`, their
    rows' logsumexp; before top-k/top-p truncation, as the sampled token's)."""
    k = min(max((p.top_logprobs for p in params), default=0), scores.shape[1])
    columns = [tokens.double()[:, None], chosen.double()[:, None]]
    if k:
        values, ids = scores.topk(k, dim=-1)
        if norm is not None:
            values = values - norm[:, None]
        columns += [ids.double(), values.double()]
    host = torch.cat(columns, dim=1).tolist()
    top: list[TopLogprobs | None] = [None] * len(params)
    for row, p in enumerate(params):
        if p.top_logprobs > 0:
            n = min(p.top_logprobs, k)
            values_at = host[row][2 + k : 2 + k + n]
            top[row] = list(zip((int(t) for t in host[row][2 : 2 + n]), values_at, strict=True))
    return [int(row[0]) for row in host], [row[1] for row in host], top
