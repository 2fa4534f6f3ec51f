"""The triton backend attends exactly what the torch backend does (fp32 tolerance), reading pages
in place: random page tables (out of order, shared between rows), context lengths, GQA ratios,
batch sizes, split-KV, shared-prefix groups and prefill spans over a cached prefix. The kernels
run in Triton's interpreter on the CPU, compiled on CUDA with `VENUSRL_TEST_DEVICE=cuda`."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import TEST_DEVICE
from venusrl.engine.attention import (
    DecodeBatch,
    PrefillSpan,
    PrefixGroup,
    PrefixTable,
    StepBatch,
    causal_mask,
    needs_prefill_mask,
    paged_attention,
)
from venusrl.engine.attention_backend import attention_backend
from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.types import SamplingParams

INTERPRETED = TEST_DEVICE.type == "cpu"


def _interpreted_kernels() -> ModuleType:
    """Triton decides when a function is decorated (its own `tl.*` helpers included, at its
    import) whether it is interpreted, so the flag is set only while triton and the kernels are
    imported, and the environment is restored after: no other test sees it. On CUDA they
    compile."""
    if not INTERPRETED:
        pytest.importorskip("triton", reason="triton is not installed (the `gpu` or `dev` extra)")
        return importlib.import_module("venusrl.engine.triton_attention")
    if "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ:
        reason = "triton was imported before TRITON_INTERPRET could be set"
        pytest.skip(reason, allow_module_level=True)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="triton is not installed (the `gpu` or `dev` extra)")
        name = "venusrl.engine.triton_attention"
        if name in sys.modules:
            return importlib.reload(sys.modules[name])
        return importlib.import_module(name)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


kernels = _interpreted_kernels()


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter reads the flag again while kernels run; set for this module's tests only."""
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


NUM_PAGES = 12  # a small pool, so that rows drawing pages at random share some


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, int]:
    return {
        "kv_heads": draw(st.integers(1, 2)),
        "group": draw(st.sampled_from([1, 2, 3, 4])),
        "dim": draw(st.sampled_from([8, 16])),
        "page_size": draw(st.sampled_from([1, 2, 4])),
    }


def _pages(draw: st.DrawFn, n: int) -> list[int]:
    """Any pages of the pool but the padding page, in any order, repeats allowed."""
    return draw(st.lists(st.integers(1, NUM_PAGES - 1), min_size=n, max_size=n))


def _decode_batch(
    draw: st.DrawFn, rows: int, page_size: int, key_dtype: torch.dtype
) -> tuple[DecodeBatch, list[int]]:
    """Decode rows over random pages, some in a shared-prefix group; returns the batch and each
    row's slot for its new token."""
    lengths = draw(st.lists(st.integers(1, 24), min_size=rows, max_size=rows))
    own = [_pages(draw, -(-n // page_size)) for n in lengths]
    slots = [own[r][(n - 1) // page_size] * page_size + (n - 1) % page_size
             for r, n in enumerate(lengths)]  # fmt: skip
    groups: list[PrefixGroup] = []
    listed: list[tuple[list[int], list[int]]] = []
    order = draw(st.permutations(range(rows)))
    bounds = [0, *sorted(draw(st.lists(st.integers(0, rows), max_size=3)))]
    for start, end in itertools.pairwise(bounds):  # up to 3 groups; rows past the last: none
        members = order[start:end]
        if len(members) < 2:
            continue
        shared = draw(st.integers(1, 3))
        contiguous = draw(st.booleans())
        first = draw(st.integers(1, NUM_PAGES - shared))
        pages = list(range(first, first + shared)) if contiguous else _pages(draw, shared)
        listed.append((list(members), pages))
        groups.append(
            PrefixGroup(
                rows=torch.tensor(members),
                first_page=pages[0],
                num_pages=shared,
                pages=None if contiguous else torch.tensor(pages),
            )
        )
    width = max(len(p) for p in own)
    lens = torch.tensor(lengths, dtype=torch.int32)
    key_mask = torch.zeros(rows, width * page_size, dtype=key_dtype)
    key_mask.masked_fill_(torch.arange(width * page_size)[None, :] >= lens[:, None], float("-inf"))
    table = torch.tensor([p + [0] * (width - len(p)) for p in own])
    prefixes = PrefixTable.of(listed, page_size, TEST_DEVICE) if listed else None
    mask = key_mask[None, :, None]
    batch = DecodeBatch(rows, table, lens, mask, tuple(groups), prefix_table=prefixes)
    return batch, slots


@st.composite
def steps(draw: st.DrawFn) -> tuple[dict[str, int], StepBatch]:
    """A step of decode rows, prefill spans (a chunk after a cached prefix), or both."""
    layout = draw(layouts())
    ps, group = layout["page_size"], layout["group"]
    decode_rows = draw(st.integers(0, 6))
    num_spans = draw(st.integers(0 if decode_rows else 1, 2))
    decode, slots = None, []
    if decode_rows:
        decode, slots = _decode_batch(draw, decode_rows, ps, torch.float32)
    spans = []
    for _ in range(num_spans):
        start, n = draw(st.integers(0, 12)), draw(st.integers(1, 20))
        pages = _pages(draw, -(-(start + n) // ps))
        row = len(slots)
        slots += [pages[p // ps] * ps + p % ps for p in range(start, start + n)]
        dev = TEST_DEVICE
        mask = causal_mask(start, n, group, dev) if needs_prefill_mask(dev) else None
        spans.append(PrefillSpan(row, n, torch.tensor(pages), start + n, mask))
    tokens = len(slots)
    batch = StepBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.zeros(tokens, dtype=torch.long),
        slots=torch.tensor(slots),
        logits_rows=torch.zeros(0, dtype=torch.long),
        decode=decode,
        prefills=tuple(spans),
    )
    return layout, _on_test_device(batch)


def _on_test_device(batch: StepBatch) -> StepBatch:
    """The step's tensors moved where the kernels run (drawn on the CPU; a prefix table is
    built there already)."""

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(TEST_DEVICE)

    d = batch.decode
    if d is not None:
        groups = tuple(replace(g, rows=to(g.rows), pages=to(g.pages)) for g in d.prefix_groups)
        d = replace(d, pages=to(d.pages), lengths=to(d.lengths), key_mask=to(d.key_mask),
                    prefix_groups=groups)  # fmt: skip
    return StepBatch(
        input_ids=batch.input_ids.to(TEST_DEVICE),
        positions=batch.positions.to(TEST_DEVICE),
        slots=batch.slots.to(TEST_DEVICE),
        logits_rows=batch.logits_rows.to(TEST_DEVICE),
        decode=d,
        prefills=tuple(replace(s, pages=to(s.pages), mask=to(s.mask)) for s in batch.prefills),
    )


def _inputs(layout: dict[str, int], tokens: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim, ps = layout["kv_heads"], layout["dim"], layout["page_size"]
    heads = kv_heads * layout["group"]
    return [
        t.to(TEST_DEVICE)
        for t in (
            torch.randn(tokens, heads, dim, generator=gen),
            torch.randn(tokens, kv_heads, dim, generator=gen),
            torch.randn(tokens, kv_heads, dim, generator=gen),
            torch.randn(2, kv_heads, NUM_PAGES, ps, dim, generator=gen),
        )
    ]


@settings(max_examples=40, deadline=None)
@given(steps(), st.integers(0, 2**16))
def test_triton_attention_equals_the_torch_backend_on_random_page_tables(
    step: tuple[dict[str, int], StepBatch], seed: int
) -> None:
    layout, batch = step
    q, k, v, layer_kv = _inputs(layout, len(batch.slots), seed)
    expected_kv = layer_kv.clone()
    expected = paged_attention(q, k, v, expected_kv, batch)
    got = kernels.triton_paged_attention(q, k, v, layer_kv, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer_kv, expected_kv, rtol=0, atol=0)  # same keys written


@settings(max_examples=10, deadline=None)
@given(steps(), st.integers(0, 2**16))
def test_bf16_pages_are_attended_in_fp32_to_within_bf16_rounding_of_the_output(
    step: tuple[dict[str, int], StepBatch], seed: int
) -> None:
    layout, batch = step
    q, k, v, layer_kv = (t.bfloat16() for t in _inputs(layout, len(batch.slots), seed))
    expected = paged_attention(q.float(), k.float(), v.float(), layer_kv.float(), batch)
    got = kernels.triton_paged_attention(q, k, v, layer_kv, batch)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


@settings(max_examples=15, deadline=None)
@given(layouts(), st.integers(1, 3), st.integers(1, 40), st.integers(0, 2**16))
def test_split_kv_merged_by_log_sum_exp_equals_one_pass(
    layout: dict[str, int], rows: int, max_len: int, seed: int
) -> None:
    """However a long context is split, the merged splits give the one-pass output and lse."""
    gen = torch.Generator().manual_seed(seed)
    ps = layout["page_size"]
    width = -(-max_len // ps)
    pages = torch.randint(1, NUM_PAGES, (rows, width), generator=gen)
    lengths = torch.randint(1, max_len + 1, (rows,), generator=gen, dtype=torch.int32)
    q = torch.randn(rows, layout["kv_heads"], layout["group"], layout["dim"], generator=gen)
    layer_kv = torch.randn(2, layout["kv_heads"], NUM_PAGES, ps, layout["dim"], generator=gen)
    q, layer_kv, pages, lengths = (t.to(TEST_DEVICE) for t in (q, layer_kv, pages, lengths))
    whole, whole_lse = kernels.paged_decode(q, layer_kv, pages, lengths, split_tokens=10_000)
    split, split_lse = kernels.paged_decode(q, layer_kv, pages, lengths, split_tokens=16)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_lse, whole_lse, rtol=1e-5, atol=1e-5)
    # The lse is that of the scaled scores over each row's keys, read through its pages.
    kv = layer_kv[:, :, pages].flatten(3, 4)  # [2, kv_heads, rows, width * ps, dim]
    scores = torch.einsum("rhgd,hrnd->rhgn", q, kv[0]) / layout["dim"] ** 0.5
    beyond = torch.arange(width * ps, device=TEST_DEVICE)[None, :] >= lengths[:, None]
    scores.masked_fill_(beyond[:, None, None], float("-inf"))
    torch.testing.assert_close(whole_lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


def test_an_engine_on_the_triton_backend_generates_what_the_torch_backend_does(
    tiny_qwen3: Path,
) -> None:
    """Prefill chunks (a 12-token budget splits prompts), a cached prefix, decode rows and
    mixed steps, end to end through the model: the same greedy tokens and logprobs; also with
    decode steps on the padded buffers of `engine.cuda_graphs` (run eagerly on a CPU, captured
    and replayed on CUDA)."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)] + [[*range(5, 5 + 17), 40, 41]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = []
    for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
        config = EngineConfig(page_size=4, device_kv_pages=256, token_budget=12, max_context=64,
                              attention_backend=backend, cuda_graphs=graphs,
                              device=str(TEST_DEVICE))  # fmt: skip
        engine = Engine.from_model_dir(tiny_qwen3, config)
        if backend == "triton":
            assert engine.forward.attention is kernels.triton_paged_attention
        outputs.append(engine.generate(prompts, params))
        assert not graphs or (engine.graphs is not None and engine.graphs._by_rows)
    for torch_out, *triton_outs in zip(*outputs, strict=True):
        for triton_out in triton_outs:
            assert triton_out.token_ids == torch_out.token_ids
            assert triton_out.logprobs == pytest.approx(torch_out.logprobs, abs=1e-4)


def test_auto_picks_torch_on_a_cpu_and_triton_refuses_one_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert attention_backend("auto", cpu) is paged_attention
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"engine\.attention_backend=triton needs a CUDA"):
        attention_backend("triton", cpu)


def test_every_shared_prefix_group_of_a_step_is_attended_in_one_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = {"kv_heads": 2, "group": 2, "dim": 16, "page_size": 2}
    members = [[0, 3, 5], [1, 2], [6, 7, 8, 9]]  # row 4 in no group
    groups = tuple(
        PrefixGroup(rows=torch.tensor(m), first_page=1 + 3 * g, num_pages=2 + g, pages=None)
        for g, m in enumerate(members)
    )
    lengths = torch.tensor([3, 1, 4, 2, 5, 3, 1, 4, 2, 3], dtype=torch.int32)
    table = torch.tensor([[10 + r % 2, 11 - r % 2, 9] for r in range(10)])
    key_mask = torch.zeros(10, 6).masked_fill_(torch.arange(6) >= lengths[:, None], float("-inf"))
    prefixes = PrefixTable.of(
        [(m, list(range(1 + 3 * g, 3 + 4 * g))) for g, m in enumerate(members)], 2, TEST_DEVICE
    )
    decode = DecodeBatch(10, table, lengths, key_mask[None, :, None], groups, (), prefixes)
    slots = [int(table[r, (n - 1) // 2]) * 2 + (n - 1) % 2 for r, n in enumerate(lengths.tolist())]
    batch = StepBatch(
        input_ids=torch.zeros(10, dtype=torch.long),
        positions=torch.zeros(10, dtype=torch.long),
        slots=torch.tensor(slots),
        logits_rows=torch.zeros(0, dtype=torch.long),
        decode=decode,
        prefills=(),
    )
    batch = _on_test_device(batch)
    q, k, v, layer_kv = _inputs(layout, 10, seed=7)
    expected = paged_attention(q, k, v, layer_kv.clone(), batch)
    launches = []
    real = kernels.paged_decode

    def counted(*args: Any, **kwargs: Any) -> Any:
        launches.append(args[2].shape)  # the page table it reads
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "paged_decode", counted)
    got = kernels.triton_paged_attention(q, k, v, layer_kv, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert launches == [(10, 3), (3, 4)]  # the rows' own pages, then every group's shared ones
