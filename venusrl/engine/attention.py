"""Attention over the paged KV cache, for one packed engine step.

A step packs every scheduled token of every sequence into one `[tokens, ...]` batch. The first
`num_decode` tokens are single-token sequences (decode): their attention runs as one batched call
over their pages, padded with the reserved page 0 and masked. Each multi-token span (a prefill
chunk, or a resumed sequence) runs on its own with a causal mask that starts at its first position.

Grouped-query attention folds the query heads of one KV head into the query-length dimension
(`[kv_heads, seqs, group, head_dim]`), so keys and values are never repeated per query head.
Pages are gathered with one `index_select` along the page dimension, which keeps the result a
view-compatible `[kv_heads, pages * page_size, head_dim]` (measured here: gather + SDPA costs a
fraction of fancy indexing, see shared/MEASURED.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    row: int  # first row of the span in the packed batch
    num_tokens: int
    pages: torch.Tensor  # page ids covering positions [0, start_pos + num_tokens)
    context_len: int  # start_pos + num_tokens
    mask: torch.Tensor  # [num_tokens * group, context_len] bool, True = may attend


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] page * page_size + offset where each token's K/V is written
    logits_rows: torch.Tensor  # rows whose logits are needed (last token of sampling sequences)
    num_decode: int
    decode_pages: torch.Tensor  # [num_decode, max_pages], padded with page 0
    decode_mask: torch.Tensor  # [1, num_decode, 1, max_pages * page_size] bool
    prefills: tuple[PrefillSpan, ...]


def causal_mask(start_pos: int, num_tokens: int, group: int, device: torch.device) -> torch.Tensor:
    """Query i (position start_pos + i) may attend keys 0..start_pos + i, repeated per head."""
    keys = torch.arange(start_pos + num_tokens, device=device)
    queries = torch.arange(start_pos, start_pos + num_tokens, device=device)
    return (keys[None, :] <= queries[:, None]).repeat_interleave(group, dim=0)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    batch: StepBatch,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d]; layer_kv: [2, kv_heads, pages, page_size, d].

    Writes this step's k and v into their slots, then attends. Returns [T, heads * d].
    """
    tokens, heads, dim = q.shape
    _, kv_heads, num_pages, page_size, _ = layer_kv.shape
    group = heads // kv_heads
    flat = layer_kv.view(2, kv_heads, num_pages * page_size, dim)
    flat[0].index_copy_(1, batch.slots, k.transpose(0, 1))
    flat[1].index_copy_(1, batch.slots, v.transpose(0, 1))

    out = q.new_empty(tokens, heads, dim)
    d = batch.num_decode
    if d:
        qd = q[:d].view(d, kv_heads, group, dim).transpose(0, 1)
        kv = layer_kv.index_select(2, batch.decode_pages.view(-1))
        kv = kv.view(2, kv_heads, d, -1, dim)
        od = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=batch.decode_mask)
        out[:d] = od.transpose(0, 1).reshape(d, heads, dim)
    for span in batch.prefills:
        n, rows = span.num_tokens, slice(span.row, span.row + span.num_tokens)
        qp = q[rows].view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
        kv = layer_kv.index_select(2, span.pages).view(2, kv_heads, -1, dim)
        kv = kv[:, :, : span.context_len]
        op = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=span.mask)
        out[rows] = op.view(kv_heads, n, group, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
    return out.view(tokens, heads * dim)
