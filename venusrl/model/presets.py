"""Named model shapes (Qwen3 architecture) for demos, tests and benchmarks; no torch, so that a
config naming one is checked without loading it."""

from __future__ import annotations

from typing import Any

# Shapes for demos and benchmarks. `tiny` is the engine-benchmark shape of docs/MEASURED.md;
# `small` is ~100M parameters, where compute rather than Python overhead dominates on CPU.
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.5M parameters: the built-in CPU training example learns in minutes on 2 cores.
    "micro": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "small": dict(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
    # Qwen/Qwen3-4B's config.json (tied embeddings, as QWEN3_DEFAULTS): the engine's and
    # trainer's GPU benchmarks' second shape.
    "qwen3-4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
}
