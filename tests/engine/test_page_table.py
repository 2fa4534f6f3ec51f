"""Page tables kept on the device between steps: each request's row holds its pages, and a
step copies only what changed."""

from __future__ import annotations

import pytest
import torch

from venusrl.engine.page_table import PageTables


def held(tables: PageTables, row: int, n: int) -> list[int]:
    return tables.table[row, :n].tolist()


def test_each_request_row_holds_its_pages_and_a_step_copies_only_what_changed() -> None:
    tables = PageTables(rows=4, max_pages=8, device=torch.device("cpu"))
    a, b = [5, 6, 7], [5, 6, 9, 10]  # siblings sharing their first two pages
    rows = tables.rows([("a", a), ("b", b)])
    assert [held(tables, r, len(p)) for r, p in zip(rows, (a, b), strict=True)] == [a, b]
    assert tables.entries_written == 7
    assert tables.rows([("a", a), ("b", b)]) == rows and tables.entries_written == 7
    b.append(11)  # a decoding request gains a page
    tables.rows([("a", a), ("b", b)])
    assert held(tables, rows[1], 5) == b and tables.entries_written == 8
    b[2:] = [3, 4]  # pages replaced after the shared ones (banded, say): rewritten from there
    tables.rows([("b", b)])
    assert held(tables, rows[1], 4) == b and tables.entries_written == 10


def test_a_new_request_takes_the_row_of_the_least_recently_used_one_outside_the_step() -> None:
    tables = PageTables(rows=2, max_pages=4, device=torch.device("cpu"))
    first = tables.rows([("a", [1]), ("b", [2])])
    tables.rows([("a", [1])])  # b is now the least recently used
    (row,) = tables.rows([("c", [2, 3])])
    assert row == first[1]
    assert held(tables, row, 2) == [2, 3] and tables.entries_written == 3  # page 2 was there
    (again,) = tables.rows([("a", [1])])
    assert again == first[0]


def test_a_request_wider_than_the_table_or_a_step_taller_than_it_is_refused() -> None:
    tables = PageTables(rows=2, max_pages=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="request r holds 5 pages; the table is 4 wide"):
        tables.rows([("r", [1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="3 requests in a step"):
        tables.rows([("a", [1]), ("b", [1]), ("c", [1])])
