"""Attention over the paged KV cache, for one packed engine step: the step's description every
backend reads, and the `torch` backend, which runs anywhere and is the others' reference
(`attention_backend.py` picks one; `triton_attention.py` reads pages in place on CUDA).

A step packs every scheduled token of every sequence into one `[tokens, ...]` batch. The first
`decode.num_rows` tokens are single-token sequences (decode); each multi-token span (a prefill
chunk, or a resumed sequence) runs on its own with a causal mask that starts at its first position.

Decode with shared prefixes. GRPO siblings share their prompt's KV pages (the radix cache hands
them the same page ids). Reading those pages once per sibling would multiply the dominant cost of
decoding by the group size, so decode attention is split in two (cascade attention): the shared
prefix is gathered once per group and attended by all members' queries in one matmul, each row's
own pages are attended separately, and the two partial softmaxes are merged exactly through their
log-sum-exp. Rows without siblings skip the prefix part.

Layer bands. A sequence that keeps only a band of its layers on device (`policy.layer_residency`)
has band pages that, in a layer outside its band, hold other sequences' layers: after its pages
are gathered, the keys and values of those are replaced by the layer read from the host tier
(decode rows and prefill spans alike). Its new tokens always land in ordinary device pages.

Grouped-query attention folds the query heads of one KV head into the query dimension
(`[kv_heads, seqs, group, head_dim]`), so keys and values are never repeated per query head.
Pages are gathered with one `index_select` along the page dimension, which yields
`[kv_heads, pages * page_size, head_dim]` without a permute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from venusrl.engine.uploads import ints


@dataclass(frozen=True)
class PrefixGroup:
    """Decode rows that share their first pages; the pages are attended once for all of them."""

    rows: torch.Tensor  # decode rows of the members
    first_page: int  # when the shared pages are contiguous, they are read in place (no copy)
    num_pages: int
    pages: torch.Tensor | None  # otherwise, their ids, gathered


@dataclass(frozen=True)
class PrefixTable:
    """The step's shared-prefix groups as tensors, for kernels that attend them all in one
    launch: each group one row whose queries are its members' (padded with its first member's,
    whose results are dropped)."""

    members: torch.Tensor  # [groups, most members] decode rows
    pages: torch.Tensor  # [groups, most pages] each group's shared pages, 0-padded
    lengths: torch.Tensor  # [groups] int32: keys in each group's shared pages
    rows: torch.Tensor  # [members of every group] their decode rows, group after group
    picks: torch.Tensor  # [members of every group] where each is in `members`, flattened

    @classmethod
    def of(
        cls, groups: Sequence[tuple[list[int], list[int]]], page_size: int, device: torch.device
    ) -> PrefixTable:
        """From each group's (member rows, shared pages), host lists: no device read."""
        most_members = max(len(m) for m, _ in groups)
        most_pages = max(len(p) for _, p in groups)
        members = [m + [m[0]] * (most_members - len(m)) for m, _ in groups]
        pages = [p + [0] * (most_pages - len(p)) for _, p in groups]
        rows = [r for m, _ in groups for r in m]
        picks = [g * most_members + j for g, (m, _) in enumerate(groups) for j in range(len(m))]
        return cls(
            members=ints(members, device),
            pages=ints(pages, device),
            lengths=ints([len(p) * page_size for _, p in groups], device, torch.int32),
            rows=ints(rows, device),
            picks=ints(picks, device),
        )


@dataclass(frozen=True)
class DecodeBatch:
    num_rows: int
    pages: torch.Tensor  # [rows, pages] each row's own pages after its shared prefix, 0-padded
    lengths: torch.Tensor  # [rows] int32: keys in each row's own pages
    key_mask: torch.Tensor  # [1, rows, 1, pages * page_size] additive: 0 valid, -inf padding
    prefix_groups: tuple[PrefixGroup, ...]
    # (row, its band pages, `first` counted among the row's own pages after its shared prefix)
    banded: tuple[tuple[int, BandedPages], ...] = ()
    # the groups as tensors, for kernels that attend them all at once (`PrefixTable.of`)
    prefix_table: PrefixTable | None = None


@dataclass(frozen=True)
class BandedPages:
    """A span's pages that hold only `layers` on device; `host` has them whole."""

    first: int  # index of the first one among the span's pages
    host: torch.Tensor  # [n] host page ids
    layers: range


class HostReads(Protocol):
    """One layer of the host pages a step reads, already on the device (`tier_copies.py`)."""

    def read(self, banded: BandedPages) -> torch.Tensor:
        """The band pages' keys and values of this layer: [2, kv_heads, tokens, dim]."""
        ...


@dataclass(frozen=True)
class PrefillSpan:
    row: int  # first row of the span in the packed batch
    num_tokens: int
    pages: torch.Tensor  # page ids covering positions [0, start_pos + num_tokens)
    context_len: int  # start_pos + num_tokens
    # [num_tokens * group, context_len] bool, True = may attend; None where the fused CPU kernel
    # runs (`needs_prefill_mask`), which takes causality as a flag
    mask: torch.Tensor | None
    banded: BandedPages | None = None


@dataclass(frozen=True)
class PrefillTable:
    """The step's prefill spans as tensors, for kernels that take them all in one launch."""

    rows: torch.Tensor  # [spans] int32: first row of each span in the packed batch
    starts: torch.Tensor  # [spans] int32: tokens cached before the span
    lengths: torch.Tensor  # [spans] int32: the span's new tokens
    pages: torch.Tensor  # [spans, pages] page ids covering each span's context, 0-padded
    max_tokens: int


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] page * page_size + offset where each token's K/V is written
    logits_rows: torch.Tensor  # rows whose logits are needed (last token of sampling sequences)
    decode: DecodeBatch | None
    prefills: tuple[PrefillSpan, ...]

    @cached_property
    def host_reads(self) -> tuple[BandedPages, ...]:
        """The pages each span reads from the host tier in the layers outside its band."""
        rows = () if self.decode is None else tuple(b for _, b in self.decode.banded)
        return rows + tuple(s.banded for s in self.prefills if s.banded is not None)

    @cached_property
    def prefill_table(self) -> PrefillTable:
        """Built on first use and kept for the step's other layers."""
        spans, dev = self.prefills, self.input_ids.device
        table = [(s.row, s.context_len - s.num_tokens, s.num_tokens) for s in spans]
        columns = ints(table, dev, torch.int32).view(-1, 3).T.contiguous()
        rows, starts, lengths = columns
        pages = torch.nn.utils.rnn.pad_sequence([s.pages for s in spans], batch_first=True)
        max_tokens = max((s.num_tokens for s in spans), default=0)
        return PrefillTable(rows, starts, lengths, pages, max_tokens)


def needs_prefill_mask(device: torch.device) -> bool:
    return device.type != "cpu" or _cpu_flash is None


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
    layer: int = 0,
    host: HostReads | None = None,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d]; layer_kv: [2, kv_heads, pages, page_size, d],
    the KV of layer `layer`, whose pages on the host tier banded spans read from `host`.

    Writes this step's k and v into their slots, then attends. Returns [T, heads * d].
    """
    tokens, heads, dim = q.shape
    _, kv_heads, num_pages, page_size, _ = layer_kv.shape
    group = heads // kv_heads
    flat = layer_kv.view(2, kv_heads, num_pages * page_size, dim)
    flat[0].index_copy_(1, batch.slots, k.transpose(0, 1))
    flat[1].index_copy_(1, batch.slots, v.transpose(0, 1))

    reads = (layer, host)
    if batch.decode is not None and not batch.prefills:  # a pure decode step: no extra copy
        qd = q.view(tokens, kv_heads, group, dim).transpose(0, 1)
        out = _decode(qd, layer_kv, batch.decode, *reads)
        return out.transpose(0, 1).reshape(tokens, heads * dim)
    out = q.new_empty(tokens, heads, dim)
    if batch.decode is not None:
        d = batch.decode.num_rows
        qd = q[:d].view(d, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, d, group, dim]
        out[:d] = _decode(qd, layer_kv, batch.decode, *reads).transpose(0, 1).reshape(d, heads, dim)
    for span in batch.prefills:
        n, rows = span.num_tokens, slice(span.row, span.row + span.num_tokens)
        kv = _gather(layer_kv, span.pages)[:, :, : span.context_len]
        if span.banded is not None:
            _read_host_layer(kv, span.banded, *reads)
        if span.mask is None:
            out[rows] = _prefill_fused(q[rows].view(n, kv_heads, group, dim), kv)
            continue
        qp = q[rows].view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
        op = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=span.mask)
        out[rows] = op.view(kv_heads, n, group, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
    return out.view(tokens, heads * dim)


def _prefill_fused(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """One span's causal attention with torch's fused CPU kernel, which never materialises the
    [queries, keys] scores (an explicit mask would, and costs O(n^2) memory and time in the math
    kernel: prefill throughput halved from 256 to 2K tokens of context). The span's own keys are
    attended causally (a square, top-left causal block); the cached prefix before them, if any,
    without a mask; the two partial softmaxes merge exactly through their log-sum-exp.

    q: [n, kv_heads, group, dim]; kv: [2, kv_heads, start + n, dim] -> [n, kv_heads * group, dim].
    """
    assert _cpu_flash is not None
    n, kv_heads, group, dim = q.shape
    start = kv.shape[2] - n
    qh = q.permute(1, 2, 0, 3)  # [kv_heads, group, n, dim]: batch = KV head, heads = its group

    def keys(part: torch.Tensor) -> torch.Tensor:
        return part[:, None].expand(kv_heads, group, part.shape[1], dim)

    out, lse = _cpu_flash(qh, keys(kv[0, :, start:]), keys(kv[1, :, start:]), 0.0, True)
    if start:
        pre, pre_lse = _cpu_flash(qh, keys(kv[0, :, :start]), keys(kv[1, :, :start]), 0.0, False)
        top = torch.maximum(lse, pre_lse)
        w_own, w_pre = (lse - top).exp(), (pre_lse - top).exp()
        out = (out * w_own[..., None] + pre * w_pre[..., None]) / (w_own + w_pre)[..., None]
    return out.permute(2, 0, 1, 3).reshape(n, kv_heads * group, dim)


def _read_host_layer(
    kv: torch.Tensor, banded: BandedPages, layer: int, host: HostReads | None
) -> None:
    """Outside the band, put the host tier's keys and values of the band pages into `kv`
    ([2, kv_heads, tokens, dim], gathered from the device, where those pages hold other
    sequences' layers)."""
    if layer in banded.layers:
        return
    assert host is not None, "band pages are read from the host tier"
    from_host = host.read(banded)
    first = banded.first * (from_host.shape[2] // len(banded.host))
    kv[:, :, first : first + from_host.shape[2]] = from_host


def _gather(layer_kv: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """K and V of `pages` ([n] or [b, n]) as [2, kv_heads, (b,) n * page_size, dim]. Pages are
    selected from a 3-D view, each page one row: `index_select` along the middle dimension of the
    5-D layer was 1.6-2.5x slower (measured for 500-3,000 pages, one thread)."""
    _, kv_heads, num_pages, page_size, dim = layer_kv.shape
    rows = layer_kv.view(2 * kv_heads, num_pages, page_size * dim)
    kv = rows.index_select(1, pages.reshape(-1))
    return kv.view(2, kv_heads, *pages.shape[:-1], -1, dim)


def _decode(
    q: torch.Tensor,
    layer_kv: torch.Tensor,
    batch: DecodeBatch,
    layer: int,
    host: HostReads | None,
) -> torch.Tensor:
    """q: [kv_heads, rows, group, dim] -> attention output of the same shape."""
    own = _gather(layer_kv, batch.pages)
    for row, banded in batch.banded:
        _read_host_layer(own[:, :, row], banded, layer, host)
    if not batch.prefix_groups:
        return F.scaled_dot_product_attention(q, own[0], own[1], attn_mask=batch.key_mask)
    own_out, own_lse = _attend(q, own[0], own[1], batch.key_mask)
    pre_out, pre_lse = _shared_prefixes(q, layer_kv, batch.prefix_groups)
    # Exact merge of two partial softmaxes: weights exp(lse - max) renormalised.
    top = torch.maximum(own_lse, pre_lse)
    w_own, w_pre = (own_lse - top).exp(), (pre_lse - top).exp()
    merged = own_out * w_own[..., None] + pre_out * w_pre[..., None]
    return merged / (w_own + w_pre)[..., None]


def _shared_prefixes(
    q: torch.Tensor, layer_kv: torch.Tensor, groups: tuple[PrefixGroup, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's members attend its shared pages once. Returns per-row output and
    log-sum-exp ([kv_heads, rows, group, dim], [kv_heads, rows, group]); rows outside every
    group get lse = -inf, so they weigh nothing in the merge."""
    kv_heads, rows, heads_per_kv, dim = q.shape
    row_out = q.new_zeros(kv_heads, rows, heads_per_kv, dim)
    row_lse = q.new_full((kv_heads, rows, heads_per_kv), -math.inf)
    for g in groups:
        if g.pages is None:
            kv = layer_kv[:, :, g.first_page : g.first_page + g.num_pages]
            kv = kv.reshape(2, kv_heads, -1, dim)  # a view: contiguous pages are read in place
        else:
            kv = _gather(layer_kv, g.pages)
        members = q.index_select(1, g.rows).reshape(kv_heads, -1, dim)
        out, lse = _attend_unmasked(members, kv[0], kv[1])
        row_out.index_copy_(1, g.rows, out.view(kv_heads, -1, heads_per_kv, dim))
        row_lse.index_copy_(1, g.rows, lse.view(kv_heads, -1, heads_per_kv))
    return row_out, row_lse


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores (for merging).
    One exp pass over the scores; measured faster than `logsumexp` + a second exp here."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
    scores.add_(mask)
    top = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(top).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v).div_(total)
    return out, (top + total.log()).squeeze(-1)


def _attend_unmasked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [kv_heads, queries, dim], k/v: [kv_heads, keys, dim] -> output and log-sum-exp.

    On CPU, torch's fused flash kernel returns the log-sum-exp too; it was 2-2.5x faster than
    `_attend` for a group's queries over a 300-1,000-token prefix. Elsewhere, or on a torch
    without that kernel, `_attend` does the same work.
    """
    if q.device.type == "cpu" and _cpu_flash is not None:
        out, lse = _cpu_flash(q[None], k[None], v[None], 0.0, False)
        return out[0], lse[0]
    return _attend(q, k, v, q.new_zeros(()))


_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
