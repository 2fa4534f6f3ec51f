"""Packed rows (the trainer's forward): a row's logits and gradients are those it has alone,
whatever rows it is packed with and however much of its start they share."""

from __future__ import annotations

import pytest
import torch

from venusrl.model.architecture import CausalLM, ModelConfig
from venusrl.model.directory import build_model
from venusrl.model.packed_rows import PackedRows, common_prefix_len, packed_attention
from venusrl.model.presets import PRESETS

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 10, 11]
ROWS = [
    [*PROMPT, 20, 21, 22],
    [*PROMPT, 30, 31, 32, 33, 34],
    PROMPT[:5],  # all of it shared with the others: it is the packing's prefix
    [*PROMPT, 20, 21],
]


@pytest.fixture(scope="module")
def model() -> CausalLM:
    hf = {**PRESETS["micro"], "model_type": "qwen3", "vocab_size": 64}
    m = build_model(ModelConfig.from_hf(hf), torch.device("cpu"), torch.float32)
    m.init_random(seed=0, std=0.2)
    return m


def logits_alone(model: CausalLM, row: list[int]) -> torch.Tensor:
    return logits(model, PackedRows.pack([row], torch.device("cpu")), list(range(len(row))))


def logits(model: CausalLM, rows: PackedRows, wanted: list[int]) -> torch.Tensor:
    return model.lm_head(model.forward_rows(rows, torch.tensor(wanted)))


def test_the_prefix_every_row_starts_with_is_packed_once() -> None:
    rows = PackedRows.pack(ROWS, torch.device("cpu"))
    assert common_prefix_len(ROWS) == rows.prefix_len == 5
    assert len(rows.input_ids) == 5 + sum(len(r) - 5 for r in ROWS)
    for i, row in enumerate(ROWS):
        at = rows.index(i, range(len(row)))
        assert rows.input_ids[at].tolist() == row
        assert rows.positions[at].tolist() == list(range(len(row)))


def test_packed_rows_have_the_logits_and_gradients_each_has_alone(model: CausalLM) -> None:
    rows = PackedRows.pack(ROWS, torch.device("cpu"))
    wanted = [j for i, row in enumerate(ROWS) for j in rows.index(i, range(len(row)))]
    packed = logits(model, rows, wanted)
    alone = torch.cat([logits_alone(model, row) for row in ROWS])
    assert torch.allclose(packed, alone, atol=1e-5)

    weights = torch.randn(alone.shape)

    def grads(logits: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (logits * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    packed_grads = grads(logits(model, rows, wanted))
    alone_grads = grads(torch.cat([logits_alone(model, row) for row in ROWS]))
    for a, b in zip(packed_grads, alone_grads, strict=True):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()  # float rounding: sums reordered


def test_the_fused_lower_right_causal_path_equals_the_explicit_softmax_and_its_gradients() -> None:
    # The fused path is CUDA's default; on a CPU SDPA materialises its mask, but the arithmetic
    # it must equal is the same.
    g = torch.Generator().manual_seed(0)
    rows = PackedRows.pack(ROWS, torch.device("cpu"))
    n, heads, kv_heads, dim = len(rows.input_ids), 4, 2, 8
    q, k, v = (
        torch.randn(n, h, dim, generator=g).requires_grad_() for h in (heads, kv_heads, kv_heads)
    )
    results = []
    for fused in (False, True):
        out = packed_attention(q, k, v, rows, fused=fused)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, grads))
    (out, grads), (fused_out, fused_grads) = results
    torch.testing.assert_close(fused_out, out, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
