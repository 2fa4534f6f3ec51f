"""Decode graphs' CPU-side logic: buckets, and persistent buffers overwritten in place each step,
padded so that extra rows touch only the padding page. The capture and replay themselves need
CUDA: the engine test below captures and replays with `VENUSRL_TEST_DEVICE=cuda`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.conftest import TEST_DEVICE
from tests.engine.test_engine import engine_for
from venusrl.engine.attention import DecodeBatch, PrefillSpan, StepBatch
from venusrl.engine.decode_graphs import DecodeGraphs, bucket_for, buckets_up_to
from venusrl.engine.kv_cache import KVCache
from venusrl.types import SamplingParams


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(8) == (1, 2, 4, 8)
    assert buckets_up_to(30) == (1, 2, 4, 8, 16, 24, 30)
    buckets = buckets_up_to(30)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 24, 25, 30)] == [1, 4, 8, 16, 24, 30, 30]
    assert bucket_for(31, buckets) is None


def _decode_step(pages: list[list[int]], lengths: list[int], page_size: int) -> StepBatch:
    rows, width = len(pages), max(len(p) for p in pages)
    lens = torch.tensor(lengths, dtype=torch.int32)
    mask = torch.zeros(rows, width * page_size)
    mask.masked_fill_(torch.arange(width * page_size)[None, :] >= lens[:, None], float("-inf"))
    last = [p[(n - 1) // page_size] * page_size + (n - 1) % page_size
            for p, n in zip(pages, lengths, strict=True)]  # fmt: skip
    return StepBatch(
        input_ids=torch.arange(10, 10 + rows),
        positions=lens.long() - 1,
        slots=torch.tensor(last),
        logits_rows=torch.arange(rows),
        decode=DecodeBatch(
            rows,
            torch.tensor([p + [0] * (width - len(p)) for p in pages]),
            lens,
            mask[None, :, None],
            (),
        ),
        prefills=(),
    )


def test_each_step_overwrites_the_buffers_and_pads_extra_rows_onto_the_padding_page() -> None:
    seen: list[StepBatch] = []

    def forward(batch: StepBatch, kv: KVCache) -> torch.Tensor:
        seen.append(batch)
        return torch.zeros(len(batch.input_ids), 5)

    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, device_pages=16)
    graphs = DecodeGraphs(forward, kv, max_rows=4, max_pages=3, capture=False)
    four = _decode_step([[3, 5], [7], [2, 9, 4], [6]], [4, 2, 5, 1], 2)
    three = _decode_step([[8], [6, 1], [11]], [1, 3, 2], 2)
    assert graphs.run(four).shape == (4, 5)
    first = seen[-1]
    assert graphs.run(three).shape == (3, 5)
    static = seen[-1]
    assert static is first  # the bucket's batch, over the same tensors, overwritten in place
    d = static.decode
    assert d is not None and d.num_rows == 4
    assert static.input_ids.tolist() == [10, 11, 12, 0]
    assert static.slots.tolist() == [16, 2, 23, 0]  # the last row's: the padding page's first
    assert d.pages.tolist() == [[8, 0, 0], [6, 1, 0], [11, 0, 0], [0, 0, 0]]
    assert d.lengths.tolist() == [1, 3, 2, 1]
    valid = (d.key_mask[0, :, 0] == 0).sum(-1)
    assert valid.tolist() == [1, 3, 2, 1] and (d.key_mask[0, :, 0] != float("-inf")).sum() == 7
    with_prefill = replace(three, prefills=(PrefillSpan(1, 2, torch.tensor([5]), 2, None),))
    assert not graphs.fits(with_prefill)  # shapes that vary run eagerly
    assert not graphs.fits(_decode_step([[1, 2, 3, 4]], [7], 2))  # wider than max_pages


def test_an_engine_with_decode_graphs_generates_what_one_without_does(tiny_qwen3: Path) -> None:
    """Batches that shrink as requests finish move between buckets; on a CPU the padded buffers
    run eagerly, so this checks their bookkeeping, not the capture (which CUDA does)."""
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 6, 9, 4)]
    params = [
        SamplingParams(max_tokens=m, temperature=t, seed=7, ignore_eos=True)
        for m, t in ((3, 0), (9, 1.0), (5, 0.7), (12, 0), (7, 1.0))
    ]
    device = str(TEST_DEVICE)
    plain = engine_for(tiny_qwen3, max_context=64, device=device).generate(prompts, params)
    engine = engine_for(tiny_qwen3, max_context=64, cuda_graphs=True, max_running=6, device=device)
    assert engine.graphs is not None
    graphed = engine.generate(prompts, params)
    # Every bucket: on CUDA recorded when the engine started, on a CPU made as the batch shrank.
    assert sorted(engine.graphs._by_rows) == [1, 2, 4, 6]
    assert engine.graphs.capture_all() == 0  # nothing left to record (on a CPU, nothing to)
    for a, b in zip(plain, graphed, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
