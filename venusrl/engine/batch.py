"""Packing one step's tokens into a forward pass: decode rows first, then prefill chunks, with
the page tables attention reads. Rows that share their cached prefix pages (GRPO siblings)
attend them once (cascade attention) when that saves enough reading."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from venusrl.engine.attention import (
    BandedPages,
    DecodeBatch,
    PrefillSpan,
    PrefixGroup,
    PrefixTable,
    StepBatch,
    causal_mask,
    needs_prefill_mask,
)
from venusrl.engine.page_table import PageTables
from venusrl.engine.request import Request
from venusrl.engine.uploads import ints
from venusrl.policy.engine_schedule import pages_for

# Decode rows sharing a prefix attend it once (cascade attention) when that saves reading at
# least this many KV tokens per layer; below it one fused SDPA call over all pages is cheaper.
CASCADE_MIN_SAVED_TOKENS = 2048


class BatchBuilder:
    def __init__(
        self,
        page_size: int,
        device: torch.device,
        query_heads_per_kv_head: int,
        kv_dtype: torch.dtype,
        host_reads: Callable[[Request, int], BandedPages | None],
        tables: PageTables,
    ) -> None:
        """`host_reads(r, skip)`: what a banded request's row reads from the host tier;
        `tables`: the decode rows' pages, kept on the device between steps."""
        self.page_size, self.device = page_size, device
        self.group, self.kv_dtype = query_heads_per_kv_head, kv_dtype
        self.host_reads = host_reads
        self.tables = tables

    def build(self, work: Sequence[tuple[Request, int]]) -> StepBatch:
        """Pack the step's tokens; `work` lists decode (single-token) entries first."""
        ps, dev, group = self.page_size, self.device, self.group
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        decoding: list[Request] = []
        prefills: list[PrefillSpan] = []
        for r, n in work:
            start = r.num_computed
            row = len(input_ids)
            input_ids.extend(r.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(r.pages[p // ps] * ps + p % ps for p in range(start, start + n))
            if start + n == r.num_tokens:
                logits_rows.append(row + n - 1)
            if n == 1:
                decoding.append(r)
            else:
                used = ints(r.pages[: pages_for(start + n, ps)], dev)
                mask = causal_mask(start, n, group, dev) if needs_prefill_mask(dev) else None
                prefills.append(PrefillSpan(row, n, used, start + n, mask, self.host_reads(r, 0)))
        tokens = ints([input_ids, positions, slots], dev)  # one copy for the three
        return StepBatch(
            input_ids=tokens[0],
            positions=tokens[1],
            slots=tokens[2],
            logits_rows=ints(logits_rows, dev),
            decode=self._decode(decoding) if decoding else None,
            prefills=tuple(prefills),
        )

    def _decode(self, rows: Sequence[Request]) -> DecodeBatch:
        """Rows that share their cached prefix pages (GRPO siblings) attend them once."""
        ps, dev = self.page_size, self.device
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(rows):
            if r.num_shared_pages:
                by_prefix.setdefault(tuple(r.pages[: r.num_shared_pages]), []).append(i)
        groups = [(pages, members) for pages, members in by_prefix.items() if len(members) > 1]
        saved_tokens = sum((len(m) - 1) * len(pages) * ps for pages, m in groups)
        if saved_tokens < CASCADE_MIN_SAVED_TOKENS:
            groups = []  # the split costs ~40 small ops per layer; not worth it for little reuse
        skip = [0] * len(rows)  # pages each row reads through its group instead
        for pages, members in groups:
            for i in members:
                skip[i] = len(pages)
        # Each row's own pages (after its shared prefix) are read out of its table row on the
        # device: the host sends four numbers a row, not the pages.
        own_pages = [pages_for(r.num_computed + 1, ps) - skip[i] for i, r in enumerate(rows)]
        own_lens = [r.num_computed + 1 - skip[i] * ps for i, r in enumerate(rows)]
        table_rows = self.tables.rows([(r.request_id, r.pages) for r in rows])
        table_rows_t, skip_t, own_pages_t, lengths = ints(
            [table_rows, skip, own_pages, own_lens], dev
        )
        width = max(own_pages)
        cols = torch.arange(width, device=dev)
        at = (skip_t[:, None] + cols).clamp_(max=self.tables.max_pages - 1)
        own = self.tables.table[table_rows_t[:, None], at]
        own.masked_fill_(cols >= own_pages_t[:, None], 0)  # the reserved padding page
        lengths = lengths.to(torch.int32)
        beyond = torch.arange(width * ps, device=dev)[None, :] >= lengths[:, None]
        # Additive (0 / -inf) once per step, rather than converted from bool in every layer.
        key_mask = torch.zeros(beyond.shape, dtype=self.kv_dtype, device=dev)
        key_mask.masked_fill_(beyond, float("-inf"))
        prefix_groups = []
        table = PrefixTable.of([(m, list(p)) for p, m in groups], ps, dev) if groups else None
        for pages, members in groups:
            contiguous = list(pages) == list(range(pages[0], pages[0] + len(pages)))
            prefix_groups.append(
                PrefixGroup(
                    rows=ints(members, dev),
                    first_page=pages[0],
                    num_pages=len(pages),
                    pages=None if contiguous else ints(pages, dev),
                )
            )
        banded = [(i, self.host_reads(r, skip[i])) for i, r in enumerate(rows)]
        return DecodeBatch(
            num_rows=len(rows),
            pages=own,
            lengths=lengths,
            key_mask=key_mask[None, :, None],
            prefix_groups=tuple(prefix_groups),
            banded=tuple((i, b) for i, b in banded if b is not None),
            prefix_table=table,
        )
