"""The GPU cost model reproduces WORKLOADS.md's worked figures."""

from __future__ import annotations

import pytest

from venusrl.sim.cost_model import CostModel


def test_qwen3_4b_on_one_h200_holds_about_765k_kv_tokens() -> None:
    cost = CostModel.preset("qwen3-4b", "h200")
    assert cost.model.kv_bytes_per_token == 144 * 1024
    assert cost.kv_capacity_tokens == pytest.approx(765_000, rel=0.01)


def test_reprefilling_64k_tokens_costs_seconds_reloading_them_a_fraction() -> None:
    cost = CostModel.preset("qwen3-4b", "h200")
    reprefill = cost.prefill_s(64_000, 0)
    reload = cost.transfer_s(64_000, to_device=True)
    assert reprefill == pytest.approx(3.4, rel=0.05)
    assert 0.2 <= reload <= 0.4


def test_decode_is_memory_bound_and_tensor_parallelism_divides_it() -> None:
    one = CostModel.preset("qwen3-32b", "h200", tp=1)
    two = CostModel.preset("qwen3-32b", "h200", tp=2)
    assert one.decode_step_s(32, 32 * 20_000) > one.decode_step_s(32, 32 * 10_000)
    assert two.decode_step_s(32, 32 * 20_000) < one.decode_step_s(32, 32 * 20_000)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # weights split too


def test_unknown_presets_and_models_that_do_not_fit_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        CostModel.preset("gpt-9", "h200")
    with pytest.raises(ValueError, match="unknown gpu"):
        CostModel.preset("qwen3-4b", "tpu")
    with pytest.raises(ValueError, match="does not fit"):
        _ = CostModel.preset("qwen3-32b", "h100", reserved_bytes=20e9).kv_capacity_tokens
