"""Layer-wise residency: under pressure, high-priority requests keep a band of their layers on
device and read the rest from host; outputs never change and no page is lost."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import write_hf_model
from tests.engine.test_engine import (
    RunnersUp,
    assert_greedy_agrees,
    drain,
    engine_for,
    margins_of,
    play_turns,
)
from venusrl.engine import batch as batch_module
from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.engine.kv_cache import KVCache
from venusrl.policy.critical_groups import HIGH
from venusrl.policy.layer_residency import LayerResidency, band_layers
from venusrl.types import SamplingParams, TurnMeta

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def four_layer_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model(
        tmp_path_factory.mktemp("four_layer_qwen3"), "qwen3", head_dim=16, num_hidden_layers=4
    )


def test_residency_halves_as_pressure_crosses_each_threshold() -> None:
    policy = LayerResidency(threshold=0.5)
    # thresholds 0.5, 0.75, 0.875, ...: one more halving at each
    assert [policy.bands(e, 8) for e in (0.0, 0.49, 0.5, 0.74, 0.75, 0.875, 5.0)] == [
        1, 1, 2, 2, 4, 8, 8,
    ]  # fmt: skip
    assert policy.bands(5.0, 2) == 2  # never fewer than one layer on device
    assert policy.bands(5.0, 1) == 1
    # Loaded back whole only a margin below the threshold: no copying back and forth at it.
    assert not policy.unband(0.49) and policy.unband(0.44)


def test_bands_cover_every_layer_once() -> None:
    for layers in (2, 4, 7, 36):
        for bands in (1, 2, 4):
            if bands <= layers:
                covered = [i for b in range(bands) for i in band_layers(b, bands, layers)]
                assert covered == list(range(layers))
    with pytest.raises(ValueError, match="does not fit"):
        band_layers(0, 4, 2)


def test_a_split_page_holds_one_band_of_each_of_its_requests() -> None:
    kv = KVCache(
        num_layers=4, num_kv_heads=1, head_dim=2, page_size=2, device_pages=8, host_pages=8
    )
    pages = kv.device_pages.allocate(4)
    for i, p in enumerate(pages):
        kv.device_kv[:, :, :, p] = float(i + 1)
    before = kv.device_kv.clone()
    low, low_host = kv.split(pages[:2], 2, 0, range(0, 2))
    high, high_host = kv.split(pages[2:], 2, 1, range(2, 4))
    # The second request's bands moved into the first one's pages: two device pages for four.
    assert high == low and kv.device_pages.num_free == 8 - 1 - 2
    for p, src in zip(low, pages[:2], strict=True):
        assert (kv.device_kv[:2, :, :, p] == before[:2, :, :, src]).all()
    for p, src in zip(high, pages[2:], strict=True):
        assert (kv.device_kv[2:, :, :, p] == before[2:, :, :, src]).all()
    for h, src in zip(low_host + high_host, pages, strict=True):
        assert (kv.host_kv[:, :, :, h] == before[:, :, :, src]).all()  # whole copies
    kv.check()
    whole = kv.unsplit(high, 1, high_host)
    assert whole is not None
    for p, src in zip(whole, pages[2:], strict=True):
        assert (kv.device_kv[:, :, :, p] == before[:, :, :, src]).all()
    for page in low:
        kv.bands.release(page, 0)
    kv.free_host(low_host)
    kv.device_pages.free(whole)
    kv.check()
    assert kv.device_pages.num_free == 7 and kv.host_pages.num_free == 8
    with pytest.raises(ValueError, match="not split"):
        kv.bands.release(low[0], 0)


@pytest.mark.parametrize("layers", [2, 4])
def test_layer_banded_requests_give_the_same_greedy_outputs(
    tiny_qwen3: Path, four_layer_qwen3: Path, layers: int
) -> None:
    model = tiny_qwen3 if layers == 2 else four_layer_qwen3
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    # Of different lengths, so the pressure falls as they finish.
    params = [
        SamplingParams(max_tokens=10 + 6 * i, temperature=0, ignore_eos=True) for i in range(6)
    ]
    reference = engine_for(model, prefix_cache=False, device_kv_pages=256)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    # Six contexts of 40-70 tokens need 90 pages of 4; the device has 47.
    engine = engine_for(
        model, device_kv_pages=48, host_kv_pages=200, layer_residency=0.45, max_context=96
    )
    ids = [
        engine.add_request(p, sp, TurnMeta(priority=HIGH)).request_id
        for p, sp in zip(prompts, params, strict=True)
    ]
    drain(engine)
    assert [engine.pop_finished(i).token_ids for i in ids] == expected
    stats = engine.stats
    assert stats.banded_pages > 0 and stats.streamed_bytes > 0
    assert stats.unbanded_pages > 0  # loaded back whole once the pressure fell
    engine.flush_cache()
    engine.check()
    assert engine.cache.kv.device_pages.num_free == engine.cache.kv.device_pages.capacity
    assert engine.cache.kv.host_pages.num_free == engine.cache.kv.host_pages.capacity


def test_banding_runs_every_high_priority_request_where_plain_paging_preempts(
    four_layer_qwen3: Path,
) -> None:
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]

    def run(residency: float | None) -> tuple[int, int, int]:
        # Six contexts of 70 tokens need 108 pages of 4; the device has 47.
        engine = engine_for(
            four_layer_qwen3,
            device_kv_pages=48,
            host_kv_pages=200,
            layer_residency=residency,
            max_context=96,
        )
        for p in prompts:
            engine.add_request(p, LONG, TurnMeta(priority=HIGH))
        most_running = 0
        while engine.has_work():
            engine.step()
            most_running = max(most_running, len(engine.running))
        return most_running, engine.stats.preemptions, engine.stats.steps

    banded, plain = run(0.3), run(None)
    assert banded[0] == len(prompts) > plain[0], (banded, plain)
    assert banded[1] < plain[1], (banded, plain)  # fewer preemptions, fewer re-prefills
    assert banded[2] < plain[2], (banded, plain)  # fewer forward passes


def test_banded_trajectories_keep_their_kv_across_turns_on_host(tiny_qwen3: Path) -> None:
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    reference = play_turns(
        engine_for(tiny_qwen3, prefix_cache=False, device_kv_pages=256), prompts, 3, False
    )
    engine = engine_for(
        tiny_qwen3, device_kv_pages=60, host_kv_pages=400, layer_residency=0.3, max_context=96
    )
    assert play_turns(engine, prompts, 3, wait_on_tools=True) == reference
    stats = engine.stats
    assert stats.banded_pages > 0 and stats.host_hit_tokens > 0
    # Returning trajectories took their offloaded turns as banded pages, not loaded whole.
    assert stats.banded_from_host_pages > 0
    engine.flush_cache()
    engine.check()
    assert engine.cache.kv.host_pages.num_free == engine.cache.kv.host_pages.capacity


def test_layer_residency_without_a_host_tier_is_refused(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="host_kv_pages"):
        Engine.from_model_dir(tiny_qwen3, EngineConfig(layer_residency=0.5))
    with pytest.raises(ValueError):
        EngineConfig(layer_residency=1.5)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    workload=st.lists(
        st.tuples(
            st.integers(0, 1),  # which shared prompt (GRPO siblings share one)
            st.lists(st.integers(2, 500), max_size=12),  # own suffix
            st.integers(1, 24),  # max tokens
            st.sampled_from([0, HIGH, HIGH]),
        ),
        min_size=2,
        max_size=7,
    ),
    pool_pages=st.integers(24, 48),
    page_size=st.sampled_from([2, 4]),
    host_pages=st.sampled_from([6, 200]),  # a host tier too small to band everything, or not
    threshold=st.sampled_from([0.2, 0.6]),
)
def test_banding_keeps_outputs_and_page_ownership_under_random_load(
    four_layer_qwen3: Path,
    workload: list,
    pool_pages: int,
    page_size: int,
    host_pages: int,
    threshold: float,
) -> None:
    prompts = [[100 + 50 * g + i for i in range(17)] + suffix for g, suffix, _, _ in workload]
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, _, m, _ in workload
    ]
    reference = engine_for(four_layer_qwen3, prefix_cache=False, device_kv_pages=256)
    outs = reference.generate(prompts, [dataclasses.replace(p, top_logprobs=2) for p in params])
    expected, margins = [o.token_ids for o in outs], [margins_of(o) for o in outs]
    engine = engine_for(
        four_layer_qwen3,
        page_size=page_size,
        device_kv_pages=max(pool_pages, 64 // page_size + 1),
        host_kv_pages=host_pages,
        layer_residency=threshold,
        max_context=64,
    )
    ids = [
        engine.add_request(
            p, sp, TurnMeta(priority=prio, trajectory_id=f"t{i}", group_id=f"g{g}")
        ).request_id
        for i, (p, sp, (g, _, _, prio)) in enumerate(zip(prompts, params, workload, strict=True))
    ]
    drain(engine)  # check() after every step
    assert_greedy_agrees(expected, margins, [engine.pop_finished(i).token_ids for i in ids])
    for i in range(len(ids)):
        engine.end_trajectory(f"t{i}")
    engine.flush_cache()
    engine.check()
    assert engine.cache.kv.device_pages.num_free == engine.cache.kv.device_pages.capacity
    assert engine.cache.kv.host_pages.num_free == engine.cache.kv.host_pages.capacity


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    suffixes=st.lists(st.lists(st.integers(2, 500), max_size=10), min_size=2, max_size=6),
    pool_pages=st.integers(30, 60),
    host_pages=st.sampled_from([10, 400]),
    threshold=st.sampled_from([0.2, 0.5]),
)
def test_banded_multi_turn_trajectories_keep_outputs_and_page_ownership(
    tiny_qwen3: Path, suffixes: list, pool_pages: int, host_pages: int, threshold: float
) -> None:
    prompts = [list(range(100, 117)) + suffix for suffix in suffixes]
    margins: list[RunnersUp] = [[] for _ in prompts]
    reference = play_turns(
        engine_for(tiny_qwen3, prefix_cache=False, device_kv_pages=256), prompts, 3, False, margins
    )
    engine = engine_for(
        tiny_qwen3,
        device_kv_pages=pool_pages,
        host_kv_pages=host_pages,
        layer_residency=threshold,
        max_context=96,
    )
    got = play_turns(engine, prompts, 3, wait_on_tools=True)  # check() each step
    assert_greedy_agrees(reference, margins, got)
    engine.flush_cache()
    engine.check()
    assert engine.cache.kv.device_pages.num_free == engine.cache.kv.device_pages.capacity
    assert engine.cache.kv.host_pages.num_free == engine.cache.kv.host_pages.capacity


def test_banded_grpo_siblings_read_their_shared_prompt_once_with_the_same_outputs(
    four_layer_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cascade attention on however little it saves: the siblings' decode rows read the prompt
    # through their group and their own band pages after it.
    monkeypatch.setattr(batch_module, "CASCADE_MIN_SAVED_TOKENS", 0)
    prompts = [list(range(100 + 50 * g, 124 + 50 * g)) for g in range(2) for _ in range(3)]
    reference = engine_for(four_layer_qwen3, prefix_cache=False, device_kv_pages=256)
    expected = [o.token_ids for o in reference.generate(prompts, LONG)]
    engine = engine_for(
        four_layer_qwen3,
        device_kv_pages=48,
        host_kv_pages=200,
        layer_residency=0.3,
        max_context=96,
    )
    ids = [
        engine.add_request(p, LONG, TurnMeta(priority=HIGH, group_id=f"g{i // 3}")).request_id
        for i, p in enumerate(prompts)
    ]
    drain(engine)
    assert [engine.pop_finished(i).token_ids for i in ids] == expected
    assert engine.stats.banded_pages > 0 and engine.stats.cached_prompt_tokens > 0
