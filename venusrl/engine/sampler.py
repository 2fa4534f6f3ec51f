"""Token sampling for one engine step: greedy rows in one batched argmax, sampled rows with a
per-request generator so a seeded request gives the same tokens whatever else is in the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from venusrl.engine.request import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """logits: [rows, vocab] fp32. Returns the sampled token ids and their logprobs."""
    if all(p.greedy for p in params):  # the common RL-eval case: no [rows, vocab] softmax
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return tokens.tolist(), chosen.tolist()
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    logprobs = torch.log_softmax(logits / temps.to(logits.device)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            probs = _truncate(logprobs[row].exp(), p.top_k, p.top_p)
            tokens[row] = torch.multinomial(probs.cpu(), 1, generator=gen)[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the top-k and the top-p nucleus (the top token always stays)."""
    if top_k <= 0 and top_p >= 1.0:
        return probs
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
