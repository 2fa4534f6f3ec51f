"""Shared fixtures: real model directories written by the reference implementation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# Two cores: oversubscribing threads makes timings (and test time) 10x worse.
torch.set_num_threads(int(os.environ.get("VENUSRL_TEST_THREADS", "1")))


def write_hf_model(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight model saved by `transformers` itself: the reference for parity tests.

    Weights use a large init std so that greedy outputs vary from token to token (with HF's
    0.02 a random model repeats one token, which would make parity tests weak).
    """
    import transformers

    config_cls = {
        "qwen3": transformers.Qwen3Config,
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
    }[model_type]
    base: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
        initializer_range=0.2,
    )
    base.update(overrides)
    torch.manual_seed(seed)
    model = config_cls(**base)
    hf = transformers.AutoModelForCausalLM.from_config(model, dtype=torch.float32)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", head_dim=16)
