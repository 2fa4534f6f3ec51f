"""Logprobs and entropy of the trained tokens from the final hidden states, never holding the
whole `[tokens, vocab]` logits: positions are projected onto the vocabulary `chunk_tokens` at a
time, in forward and again (recomputed) in backward. For Qwen3's 152K vocabulary the whole fp32
logits of a 16K-token micro-batch are ~10 GB, and a log-softmax with entropy keeps several of them.

With z = h W^T / temperature, p = softmax(z), lp = log p, H = -sum(p lp), the gradients are
  d lp[token] / dz = onehot(token) - p,    dH / dz = -p (lp + H),
so backward needs only h, W, the tokens and each position's log-sum-exp (saved, [tokens] floats).
"""

from __future__ import annotations

from typing import Any

import torch


def token_logprobs(
    hidden: torch.Tensor,  # [T, hidden]: the final (normed) hidden states that predict `tokens`
    head: torch.Tensor,  # [vocab, hidden]: the output projection (lm_head.weight)
    tokens: torch.Tensor,  # [T]
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each token, entropy of each position's distribution), both [T] in fp32 (fp64
    for fp64 inputs), under softmax(h W^T / temperature); differentiable with respect to `hidden`
    and `head`."""
    if hidden.dim() != 2 or head.dim() != 2 or hidden.shape[1] != head.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and head {tuple(head.shape)} must be [T, d] and [V, d]"
        )
    if tokens.shape != hidden.shape[:1]:
        raise ValueError(f"one token per hidden state: {tuple(tokens.shape)} vs {hidden.shape[0]}")
    if not temperature > 0 or chunk_tokens < 1:
        raise ValueError(
            f"temperature ({temperature}) and chunk_tokens ({chunk_tokens}) must be > 0"
        )
    out = _ChunkedLogprobs.apply(hidden, head, tokens, temperature, chunk_tokens)
    return out[0], out[1]


def _logits_dtype(head: torch.Tensor) -> torch.dtype:
    return torch.promote_types(head.dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, head: torch.Tensor, temperature: float) -> torch.Tensor:
    # The same arithmetic as the engine's sampler: project in the model's dtype, scale in fp32.
    return (h @ head.T).to(_logits_dtype(head)).div_(temperature)


def _chunk_forward(
    h: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) of one chunk; two [chunk, vocab] buffers at most, freed on return."""
    z = _chunk_logits(h, head, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    z -= lse[:, None]  # now log p, in place
    return logp, -z.exp().mul_(z).sum(-1), lse


def _chunk_grad(
    h: torch.Tensor,
    head: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
) -> torch.Tensor:
    """d loss / d logits of one chunk (the logits before / temperature), in two buffers:
    dz = g_lp (onehot - p) - g_H p (lp + H), built in lp's."""
    lp = _chunk_logits(h, head, temperature).sub_(lse[:, None])
    p = lp.exp()
    dz = lp.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
    dz.sub_(p.mul_(grad_logp[:, None]))
    dz.scatter_add_(-1, tokens[:, None], grad_logp[:, None])
    return dz.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        head: torch.Tensor,
        tokens: torch.Tensor,
        temperature: float,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=_logits_dtype(head), device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for lo in range(0, n, chunk_tokens):
            hi = min(lo + chunk_tokens, n)
            chunk = _chunk_forward(hidden[lo:hi], head, tokens[lo:hi], temperature)
            logp[lo:hi], entropy[lo:hi], lse[lo:hi] = chunk
        ctx.save_for_backward(hidden, head, tokens, lse, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        # Backward recomputes the logits as forward computed them: under the same autocast
        # (bf16 matmuls), or their softmax would not match the saved log-sum-exp.
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, head, tokens, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk_tokens
        need_hidden, need_head = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Summed over chunks in fp32 (a bf16 sum of many chunks would lose their small terms).
        grad_head = (
            torch.zeros(head.shape, dtype=_logits_dtype(head), device=head.device)
            if need_head
            else None
        )
        device, dtype, enabled = ctx.autocast
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            h, at = hidden[lo:hi], slice(lo, hi)
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                dz = _chunk_grad(
                    h, head, tokens[at], t, lse[at], entropy[at], grad_logp[at], grad_entropy[at]
                )
                if grad_hidden is not None:
                    grad_hidden[lo:hi] = dz.to(head.dtype) @ head
            if grad_head is not None:
                grad_head.addmm_(dz.T, h.to(grad_head.dtype))
            del dz  # before the next chunk's buffers exist
        if grad_head is not None:
            grad_head = grad_head.to(head.dtype)
        return grad_hidden, grad_head, None, None, None
