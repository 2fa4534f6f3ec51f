"""Greedy generation matches Hugging Face `transformers` token for token, for several shapes,
with and without prefix-cache hits and preemption; log-probabilities agree to 1e-4.

Every shape has a RoPE base other than 10,000, saved by the installed `transformers` in whichever
form it writes (5.x nests it in `rope_parameters`), so a loader that misses it fails here.

Both models run in fp32 on `VENUSRL_TEST_DEVICE`, ours on the `VENUSRL_TEST_ATTENTION` backend
(CPU and torch by default; benchmarks/gpu_check.sh runs them on CUDA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TEST_ATTENTION, TEST_DEVICE, write_hf_model
from venusrl.engine import batch as batch_module
from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

NEW_TOKENS = 32
LOGPROB_TOL = 1e-4

SHAPES: dict[str, dict[str, Any]] = {
    # GQA ratio 1, head_dim (32) != hidden / heads (16), tied embeddings, 2 layers
    "qwen3-mha-tied": dict(
        model_type="qwen3",
        rope_theta=1000000.0,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
        num_hidden_layers=2,
    ),
    # GQA ratio 2, untied, 3 layers
    "qwen3-gqa2": dict(
        model_type="qwen3",
        rope_theta=500000.0,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=3,
    ),
    # GQA ratio 4, head_dim 24, 6 layers
    "qwen3-gqa4-deep": dict(
        model_type="qwen3",
        rope_theta=1000000.0,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=24,
        num_hidden_layers=6,
    ),
    # q/k/v bias, no QK norm
    "qwen2-bias": dict(
        model_type="qwen2", rope_theta=1000000.0, num_key_value_heads=2, num_hidden_layers=2
    ),
    # neither bias nor QK norm, GQA ratio 4
    "llama-gqa4": dict(
        model_type="llama",
        rope_theta=500000.0,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=3,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = dict(SHAPES[request.param])
    model_type = shape.pop("model_type")
    return write_hf_model(tmp_path_factory.mktemp(request.param), model_type, seed=1, **shape)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf.to(TEST_DEVICE).eval()


def engine_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(device=str(TEST_DEVICE), attention_backend=TEST_ATTENTION, **overrides)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def reference_tokens(hf: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """HF greedy generation that, like `ignore_eos`, neither stops at nor suppresses EOS."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        torch.tensor([prompt], device=hf.device),
        max_new_tokens=n,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
    )
    return out[0, len(prompt) :].tolist()


def reference_logprobs(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device=hf.device)
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def assert_matches_reference(hf: Any, prompt: list[int], out: GenerationOutput) -> None:
    expected = reference_tokens(hf, prompt)
    assert len(set(expected)) > 4, "reference output too repetitive for a meaningful check"
    assert out.token_ids == expected
    ours = torch.tensor(out.logprobs)
    torch.testing.assert_close(
        ours, reference_logprobs(hf, prompt, expected), atol=LOGPROB_TOL, rtol=0
    )


def run_checked(
    engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY
) -> list[GenerationOutput]:
    ids = [engine.add_request(p, params).request_id for p in batch]
    while engine.has_work():
        engine.step()
        engine.check()
    return [engine.pop_finished(i) for i in ids]


def test_greedy_matches_transformers_token_for_token(model_dir: Path, reference: Any) -> None:
    engine = Engine.from_model_dir(model_dir, engine_config(page_size=4, device_kv_pages=256))
    batch = prompts(0, (3, 17, 40, 64))
    for prompt, out in zip(batch, run_checked(engine, batch), strict=True):
        assert out.cached_prompt_tokens == 0
        assert_matches_reference(reference, prompt, out)


def test_greedy_parity_holds_with_prefix_cache_hits(model_dir: Path, reference: Any) -> None:
    engine = Engine.from_model_dir(model_dir, engine_config(page_size=4, device_kv_pages=256))
    shared = prompts(1, (30,))[0]
    run_checked(engine, [shared])
    # A later turn (context + new tokens) and a sibling (same prompt) both hit the cache.
    longer = shared + prompts(2, (9,))[0]
    outs = run_checked(engine, [longer, shared])
    assert outs[0].cached_prompt_tokens >= 28 and outs[1].cached_prompt_tokens >= 28
    assert_matches_reference(reference, longer, outs[0])
    assert_matches_reference(reference, shared, outs[1])


def test_siblings_decoding_through_shared_prefix_attention_match_transformers(
    model_dir: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Force the cascade path (shared prefix attended once per group) even for short prompts.
    monkeypatch.setattr(batch_module, "CASCADE_MIN_SAVED_TOKENS", 0)
    engine = Engine.from_model_dir(model_dir, engine_config(page_size=4, device_kv_pages=256))
    used = []
    build = engine.batches._decode
    monkeypatch.setattr(engine.batches, "_decode", lambda rows: used.append(b := build(rows)) or b)
    group_a, group_b = prompts(6, (37, 22))
    batch = [group_a] * 3 + [group_b] * 2 + [prompts(7, (9,))[0]]
    outs = run_checked(engine, batch)
    assert any(len(b.prefix_groups) == 2 for b in used)
    for prompt, out in zip(batch, outs, strict=True):
        assert_matches_reference(reference, prompt, out)


def test_greedy_parity_holds_across_preemption(model_dir: Path, reference: Any) -> None:
    # 24 pages x 4 tokens cannot hold three sequences of ~40 + 32 tokens: some are preempted
    # mid-generation and resumed from the prefix cache plus recomputation.
    cfg = engine_config(page_size=4, device_kv_pages=49, max_context=192, token_budget=64)
    engine = Engine.from_model_dir(model_dir, cfg)
    batch = prompts(3, (41, 38, 45))
    outs = run_checked(engine, batch)
    assert engine.stats.preemptions > 0
    for prompt, out in zip(batch, outs, strict=True):
        assert_matches_reference(reference, prompt, out)


def test_high_priority_request_preempts_and_still_matches(model_dir: Path, reference: Any) -> None:
    # 32 pages x 4 tokens: the urgent request cannot be admitted beside both running ones.
    cfg = engine_config(page_size=4, device_kv_pages=33, max_context=128, token_budget=64)
    engine = Engine.from_model_dir(model_dir, cfg)
    low = [engine.add_request(p, GREEDY, TurnMeta(priority=0)) for p in prompts(4, (40, 44))]
    for _ in range(6):
        engine.step()
    urgent_prompt = prompts(5, (50,))[0]
    urgent = engine.add_request(urgent_prompt, GREEDY, TurnMeta(priority=10))
    finished_order = []
    while engine.has_work():
        finished_order += [r.request_id for r in engine.step()]
        engine.check()
    assert engine.stats.preemptions > 0
    assert finished_order[0] == urgent.request_id
    assert_matches_reference(reference, urgent_prompt, engine.pop_finished(urgent.request_id))
    for r in low:
        assert_matches_reference(reference, r.prompt_ids, engine.pop_finished(r.request_id))
