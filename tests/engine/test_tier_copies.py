"""Copies between the KV tiers: streamed layers staged one layer ahead, and whole pages moved
on a side stream. The stream and event ordering exists on CUDA only; its tests run there
(benchmarks/gpu_check.sh) and are skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from venusrl.engine.attention import BandedPages
from venusrl.engine.kv_cache import KVCache
from venusrl.engine.tier_copies import StreamedLayers

LAYERS, HEADS, PAGE, DIM = 4, 2, 4, 8
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cache(device: str, pages: int) -> KVCache:
    return KVCache(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        page_size=PAGE,
        device_pages=pages,
        host_pages=pages,
        device=device,
    )


def filled_cache(device: str = "cpu") -> KVCache:
    """Every host page allocated and random."""
    kv = cache(device, pages=16)
    g = torch.Generator().manual_seed(0)
    kv.host_kv.copy_(torch.randn(kv.host_kv.shape, generator=g))
    kv.host_pages.allocate(16)
    return kv


def host_layer(kv: KVCache, layer: int, pages: list[int]) -> torch.Tensor:
    """What a banded span reads in `layer`: [2, kv_heads, tokens, dim]."""
    data = kv.host_kv[layer][:, :, pages]
    return data.reshape(2, HEADS, len(pages) * PAGE, DIM)


def spans() -> tuple[BandedPages, BandedPages]:
    low = BandedPages(first=0, host=torch.tensor([3, 1, 7]), layers=range(0, 2))
    high = BandedPages(first=2, host=torch.tensor([5, 2]), layers=range(2, 4))
    return low, high


def test_each_layer_streams_only_the_host_pages_of_the_spans_whose_band_leaves_it_out() -> None:
    kv = filled_cache()
    low, high = spans()
    streamed = StreamedLayers([low, high], kv.copies)
    for layer in range(LAYERS):
        host = streamed.layer(layer)
        assert host is not None
        reader, keeper = (high, low) if layer in low.layers else (low, high)
        assert torch.equal(host.read(reader).cpu(), host_layer(kv, layer, reader.host.tolist()))
        with pytest.raises(KeyError):  # its band holds this layer on device: never copied
            host.read(keeper)
        streamed.prefetch(after=layer)


def test_the_next_reading_layer_is_staged_as_soon_as_the_current_one_is_queued() -> None:
    kv = filled_cache()
    low = BandedPages(first=0, host=torch.tensor([4]), layers=range(1, 3))  # reads 0 and 3
    streamed = StreamedLayers([low], kv.copies)
    assert streamed.staged == (0,)  # before the step's first layer
    assert streamed.layer(0) is not None
    streamed.prefetch(after=0)
    assert streamed.staged == (3,)  # layers 1 and 2 read nothing from the host
    assert streamed.layer(1) is None and streamed.layer(2) is None
    assert streamed.layer(3) is not None
    streamed.prefetch(after=3)
    assert streamed.staged == ()


@cuda
def test_streamed_layers_on_cuda_equal_the_host_tier() -> None:
    kv = filled_cache("cuda")
    low, high = spans()
    streamed = StreamedLayers([low, high], kv.copies)
    for layer in range(LAYERS):
        host = streamed.layer(layer)
        assert host is not None
        reader = high if layer in low.layers else low
        got = host.read(reader) * 1  # a kernel on the compute stream, after the copy
        assert torch.equal(got.cpu(), host_layer(kv, layer, reader.host.tolist()))
        streamed.prefetch(after=layer)


@cuda
def test_offloaded_pages_land_on_the_host_before_anything_reads_them() -> None:
    kv = cache("cuda", pages=64)
    pages = kv.device_pages.allocate(32)
    kv.device_kv.normal_()
    before = kv.device_kv[:, :, :, pages].cpu()
    host = kv.to_host(pages)
    kv.device_kv.zero_()  # queued after the offload's read: it must not reach the host copy
    back = kv.to_device(host)
    assert back is not None
    assert torch.equal(kv.device_kv[:, :, :, back].cpu(), before)
    kv.copies.settle()
    assert kv.copies.in_flight == 0
    assert torch.equal(kv.host_kv[:, :, :, host], before)
