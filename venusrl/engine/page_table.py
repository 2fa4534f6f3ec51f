"""Page tables kept on the device from one step to the next.

Building a decode step's page table from Python lists costs host work in proportion to rows x
pages and a copy of the whole table to the device, every step; on a GPU a decode step of a
small model takes less time than that. Instead each running request holds a row of one
persistent device table, a step writes only the entries that changed since the row was last
written (a decoding request gains a page every `page_size` tokens), and the step's own table is
gathered from the rows on the device (`BatchBuilder`). This is the request-to-page pool of
SGLang and the block table of vLLM, by another name.

Rows are not released when a request stops: a row goes to a new request when none is free,
taken from the request that used its row least recently and is not in the step. The host keeps
what every row holds, so a row taken over is rewritten only where it differs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from venusrl.engine.uploads import ints


class PageTables:
    def __init__(self, rows: int, max_pages: int, device: torch.device) -> None:
        """`rows`: the most requests in one step; `max_pages`: pages of the longest context."""
        self.max_pages = max_pages
        self.table = torch.zeros(rows, max_pages, dtype=torch.long, device=device)
        self._row_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._held: list[list[int]] = [[] for _ in range(rows)]  # each row's entries, as written
        self._free = list(range(rows - 1, -1, -1))
        self.entries_written = 0  # since start: what the steps copied to the device

    def rows(self, requests: Sequence[tuple[str, list[int]]]) -> list[int]:
        """The rows of (request id, pages) for one step, brought up to date in one copy."""
        in_step = {rid for rid, _ in requests}
        if len(in_step) > self.table.shape[0]:
            raise ValueError(f"{len(in_step)} requests in a step; the table has {len(self._held)}")
        index: list[int] = []
        values: list[int] = []
        rows = []
        for rid, pages in requests:
            if len(pages) > self.max_pages:
                raise ValueError(
                    f"request {rid} holds {len(pages)} pages; the table is {self.max_pages} wide"
                )
            row = self._row(rid, in_step)
            held = self._held[row]
            same = _common_prefix(held, pages)
            if same < len(pages):
                base = row * self.max_pages
                index.extend(range(base + same, base + len(pages)))
                values.extend(pages[same:])
                self._held[row] = held = held[:same] + pages[same:]
            rows.append(row)
        self.entries_written += len(index)
        if index:
            changed = ints([index, values], self.table.device)
            self.table.view(-1).index_copy_(0, changed[0], changed[1])
        return rows

    def _row(self, rid: str, in_step: set[str]) -> int:
        row = self._row_of.get(rid)
        if row is not None:
            self._row_of.move_to_end(rid)
            return row
        if self._free:
            row = self._free.pop()
        else:
            owner = next(o for o in self._row_of if o not in in_step)
            row = self._row_of.pop(owner)
        self._row_of[rid] = row
        return row


def _common_prefix(held: list[int], pages: list[int]) -> int:
    """How many leading entries `held` and `pages` share (a row that only grew: all of held)."""
    n = len(held)
    if n <= len(pages) and pages[:n] == held:
        return n
    same = 0
    for a, b in zip(held, pages, strict=False):
        if a != b:
            break
        same += 1
    return same
