"""The `triton` attention backend: paged attention that reads KV pages in place.

The torch backend (`attention.py`) copies each row's pages into a dense tensor in every layer;
these kernels instead look every key up through the page table (`[2, kv_heads, pages,
page_size, dim]`, kv_cache.py's layout, any page size), so pages may be out of order or shared
between rows. Decode runs one program per (row, KV head, split) with the KV head's query heads
as the rows of one matmul (GQA never repeats keys); long contexts are split so that a small
batch still fills the GPU, and the splits merge exactly through their log-sum-exp. A shared
prefix (cascade) is the same kernel with each group's members' queries stacked as one row,
every group of the step in one launch.
Extend (prefill chunks over a cached prefix) is one launch over every span of the step, a program
serving a KV head's query heads for a block of tokens.

Tested against the torch backend under TRITON_INTERPRET=1 on a CPU; untested on CUDA so far.
Steps with layer bands (host-tier reads) fall back to the torch backend.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from venusrl.engine.attention import (
    DecodeBatch,
    HostReads,
    PrefillTable,
    PrefixTable,
    StepBatch,
    paged_attention,
)

# Decode splits a row's context so that rows x KV heads x splits programs fill the GPU; a split
# covers at least this many tokens, below which the merge costs more than it spreads.
MIN_SPLIT_TOKENS = 256
TARGET_PROGRAMS = 264  # two per SM of an H100/H200 (132 SMs); a guess, unmeasured
# Extend: rows (tokens x a KV head's query heads) of one program's matmul; a guess, unmeasured.
EXTEND_ROWS = 64


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    batch: StepBatch,
    layer: int = 0,
    host: HostReads | None = None,
) -> torch.Tensor:
    """Same contract as `attention.paged_attention`."""
    if batch.host_reads:
        return paged_attention(q, k, v, layer_kv, batch, layer, host)
    q = q.contiguous()  # `out` takes its strides
    tokens, heads, dim = q.shape
    _, kv_heads, num_pages, page_size, _ = layer_kv.shape
    flat = layer_kv.view(2, kv_heads, num_pages * page_size, dim)
    flat[0].index_copy_(1, batch.slots, k.transpose(0, 1))
    flat[1].index_copy_(1, batch.slots, v.transpose(0, 1))
    out = torch.empty_like(q)
    if batch.decode is not None:
        rows = batch.decode.num_rows
        qd = q[:rows].view(rows, kv_heads, heads // kv_heads, dim)
        out[:rows] = decode(qd, layer_kv, batch.decode).view(rows, heads, dim)
    if batch.prefills:
        extend(q, layer_kv, batch.prefill_table, out)
    return out.view(tokens, heads * dim)


def decode(q: torch.Tensor, layer_kv: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """q: [rows, kv_heads, group, dim] -> attention output of the same shape and dtype."""
    out, lse = paged_decode(q, layer_kv, batch.pages, batch.lengths)
    if batch.prefix_groups:
        assert batch.prefix_table is not None, "the batch builder makes one with the groups"
        _add_shared_prefixes(q, layer_kv, batch.prefix_table, out, lse)
    return out.to(q.dtype)


def _add_shared_prefixes(
    q: torch.Tensor, layer_kv: torch.Tensor, t: PrefixTable, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Every group's members attend its shared pages in one launch (each group one row, its
    members' queries stacked), merged into the rows' own attention `out`/`lse` in place."""
    groups, most = t.members.shape
    kv_heads, group, dim = q.shape[1:]
    stacked = q[t.members].permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, most * group, dim)
    pre, pre_lse = paged_decode(stacked, layer_kv, t.pages, t.lengths)
    pre = pre.view(groups, kv_heads, most, group, dim).transpose(1, 2)
    pre_lse = pre_lse.view(groups, kv_heads, most, group).transpose(1, 2)
    pre = pre.reshape(groups * most, kv_heads, group, dim).index_select(0, t.picks)
    pre_lse = pre_lse.reshape(groups * most, kv_heads, group).index_select(0, t.picks)
    merged, merged_lse = merge_partials(
        torch.stack([out.index_select(0, t.rows), pre]),
        torch.stack([lse.index_select(0, t.rows), pre_lse]),
    )
    out.index_copy_(0, t.rows, merged)
    lse.index_copy_(0, t.rows, merged_lse)


def paged_decode(
    q: torch.Tensor,
    layer_kv: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    split_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over its pages. q: [rows, kv_heads, group, dim]; pages: [rows, n] page
    ids; lengths: [rows] keys per row (>= 1). Returns the output in fp32 (same shape as q) and
    the log-sum-exp of the scaled scores, [rows, kv_heads, group]."""
    rows, kv_heads, group, dim = q.shape
    page_size = layer_kv.shape[3]
    width = pages.shape[1] * page_size  # a bound on every length, known without a sync
    if split_tokens is None:
        splits = min(
            triton.cdiv(width, MIN_SPLIT_TOKENS), triton.cdiv(TARGET_PROGRAMS, rows * kv_heads)
        )
        split_tokens = triton.cdiv(width, max(splits, 1))
    splits = triton.cdiv(width, split_tokens)
    block_n = 16
    split_tokens = triton.cdiv(split_tokens, block_n) * block_n
    partial = q.new_empty(rows, kv_heads, splits, group, dim, dtype=torch.float32)
    partial_lse = q.new_empty(rows, kv_heads, splits, group, dtype=torch.float32)
    q = q.contiguous()
    pages = pages.contiguous()
    _decode_kernel[(rows, kv_heads, splits)](
        q, layer_kv, pages, lengths, partial, partial_lse,
        1.0 / math.sqrt(dim), split_tokens,
        *q.stride()[:3], *layer_kv.stride()[:4], pages.stride(0),
        GROUP=group, DIM=dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
    )  # fmt: skip
    if splits == 1:
        return partial[:, :, 0], partial_lse[:, :, 0]
    return merge_partials(partial.movedim(2, 0), partial_lse.movedim(2, 0))


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over disjoint key sets, merged exactly: out [parts, ..., dim] and lse
    [parts, ...] -> the attention over their union and its log-sum-exp. A part without keys has
    lse = -inf and weighs nothing."""
    top = lse.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = (lse - top).exp()
    total = weights.sum(0)
    merged = (out * weights[..., None]).sum(0) / total[..., None]
    return merged, top + total.log()


def extend(q: torch.Tensor, layer_kv: torch.Tensor, table: PrefillTable, out: torch.Tensor) -> None:
    """Every prefill span of the step in one launch: each new token attends its span's cached
    prefix and the span's tokens up to itself (causal), all read from the pages. q, out:
    [T, heads, dim]; writes the spans' rows of `out`. A program serves one KV head: its query
    heads and a block of tokens are the rows of one matmul, so each key is read once per KV
    head rather than once per query head."""
    heads, dim = q.shape[1:]
    kv_heads, page_size = layer_kv.shape[1], layer_kv.shape[3]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, EXTEND_ROWS // group_pad)  # tokens per program
    grid = (len(table.rows), kv_heads, triton.cdiv(table.max_tokens, block_m))
    _extend_kernel[grid](
        q, layer_kv, table.pages, table.rows, table.starts, table.lengths, out,
        1.0 / math.sqrt(dim),
        q.stride(0), q.stride(1), *layer_kv.stride()[:4], table.pages.stride(0),
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_R=block_m * group_pad, BLOCK_N=16,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION=_precision(q.dtype),
    )  # fmt: skip


def _precision(dtype: torch.dtype) -> str:
    """Keys and values are read in their dtype and multiplied in fp32: fp32 models ask for
    parity with the torch backend (no TF32); bf16/fp16 lose nothing to TF32's 10-bit mantissa.
    (Triton's interpreter also multiplies bf16 wrongly: 3.9 on a CPU gave 1e10 errors.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _kv_tile(
    kv_ptr, table_ptr, n, valid, head, d,
    stride_kv, stride_kv_head, stride_kv_page, stride_kv_token,
    DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """Keys and values of positions `n` of one KV head, read in place through the page table
    at `table_ptr` (positions not `valid` read as 0), in fp32."""
    page = tl.load(table_ptr + n // PAGE_SIZE, mask=valid, other=0)
    # int64: a KV head's stride times its index passes 2**31 on large caches
    key = kv_ptr + head.to(tl.int64) * stride_kv_head + page * stride_kv_page
    key = key + (n % PAGE_SIZE) * stride_kv_token
    kv_mask = valid[:, None] & (d[None, :] < DIM)
    k = tl.load(key[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(key[:, None] + stride_kv + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def _attend_tile(q, k, v, allowed, top, total, acc, sm_scale, PRECISION: tl.constexpr):
    """One tile of keys into the online softmax: the running max `top`, the sum of exponents
    `total` and the weighted values `acc`, rescaled to the new max."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    scores = tl.where(allowed, scores, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, 1))
    rescale = tl.exp(top - new_top)
    probs = tl.exp(scores - new_top[:, None])
    total = total * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision=PRECISION)
    return new_top, total, acc


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, pages_ptr, lengths_ptr, out_ptr, lse_ptr,
    sm_scale, split_tokens,
    stride_q_row, stride_q_head, stride_q_group,
    stride_kv, stride_kv_head, stride_kv_page, stride_kv_token, stride_pages_row,
    GROUP: tl.constexpr, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < DIM)
    q_addr = q_ptr + row * stride_q_row + head * stride_q_head + g[:, None] * stride_q_group
    q = tl.load(q_addr + d[None, :], mask=q_mask, other=0.0).to(tl.float32)

    length = tl.load(lengths_ptr + row)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, length)
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        valid = n < end
        k, v = _kv_tile(
            kv_ptr, pages_ptr + row * stride_pages_row, n, valid, head, d,
            stride_kv, stride_kv_head, stride_kv_page, stride_kv_token, DIM, PAGE_SIZE,
        )  # fmt: skip
        top, total, acc = _attend_tile(
            q, k, v, valid[None, :], top, total, acc, sm_scale, PRECISION
        )

    # A split past the row's end has no keys: output 0, lse -inf, so the merge ignores it.
    has_keys = total > 0
    out = acc / tl.where(has_keys, total, 1.0)[:, None]
    lse = tl.where(has_keys, top + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
    part = (row * tl.num_programs(1) + head) * num_splits + split
    tl.store(out_ptr + (part * GROUP + g[:, None]) * DIM + d[None, :], out, mask=q_mask)
    tl.store(lse_ptr + part * GROUP + g, lse, mask=g < GROUP)


@triton.jit
def _extend_kernel(
    q_ptr, kv_ptr, pages_ptr, rows_ptr, starts_ptr, lengths_ptr, out_ptr,
    sm_scale,
    stride_q_token, stride_q_head,
    stride_kv, stride_kv_head, stride_kv_page, stride_kv_token, stride_pages_span,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    span = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    first_row = tl.load(rows_ptr + span)
    start = tl.load(starts_ptr + span)  # tokens already cached before the span
    num_tokens = tl.load(lengths_ptr + span)

    # Row r of the block: token r // GROUP_PAD, query head r % GROUP_PAD of this KV head.
    r = tl.arange(0, BLOCK_R)
    i = block * BLOCK_M + r // GROUP_PAD
    q_head = kv_head * GROUP + r % GROUP_PAD
    d = tl.arange(0, BLOCK_D)
    is_query = (i < num_tokens) & (r % GROUP_PAD < GROUP)
    q_mask = is_query[:, None] & (d[None, :] < DIM)
    q_addr = q_ptr + (first_row + i[:, None]) * stride_q_token + q_head[:, None] * stride_q_head
    q = tl.load(q_addr + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    position = start + i

    # Keys up to the block's last query, causal within; a block past the span's end reads one.
    key_end = start + tl.maximum(tl.minimum(num_tokens, (block + 1) * BLOCK_M), 1)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for first in range(0, key_end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        valid = n < key_end
        k, v = _kv_tile(
            kv_ptr, pages_ptr + span * stride_pages_span, n, valid, kv_head, d,
            stride_kv, stride_kv_head, stride_kv_page, stride_kv_token, DIM, PAGE_SIZE,
        )  # fmt: skip
        # Key 0 is in the first block and allowed for every query, so `top` is finite after it.
        allowed = valid[None, :] & (n[None, :] <= position[:, None])
        top, total, acc = _attend_tile(q, k, v, allowed, top, total, acc, sm_scale, PRECISION)

    out = acc / total[:, None]
    out_addr = out_ptr + (first_row + i[:, None]) * stride_q_token + q_head[:, None] * stride_q_head
    tl.store(out_addr + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
