"""The trainer-memory accounting agrees with the measured peak of real training steps, and the
chunked logprobs' peak grows with the chunk, not with the tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.benchmarks import refused, run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from trainer_memory import measured_peak

from venusrl.trainer.chunked_logprobs import token_logprobs

torch.set_num_threads(1)


def test_the_accounting_is_within_its_tolerance_of_measured_training_steps() -> None:
    proc = run_benchmark("trainer_memory.py", "--small")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tolerance"] <= 0.05
    assert {c["lora_rank"] > 0 for c in out["checks"]} == {True, False}  # LoRA steps checked too
    assert {c["chunk_tokens"] < sum(c["rows"]) for c in out["checks"]} == {True, False}
    for check in out["checks"]:
        predicted, measured = check["predicted_bytes"]["total"], check["measured_peak_bytes"]
        assert abs(predicted / measured - 1) <= out["tolerance"], check
        assert check["predicted_over_measured"] == round(predicted / measured, 3)


def test_a_micro_batch_too_small_is_refused() -> None:
    code, stderr = refused("trainer_memory.py", "--tokens", "1")
    assert code != 0 and "--tokens must be >= 2" in stderr


def logprobs_peak(tokens: int, chunk: int, vocab: int = 4096) -> int:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 32, generator=g, requires_grad=True)
    head = torch.randn(vocab, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, vocab, (tokens,), generator=g)

    def step() -> None:
        logp, entropy = token_logprobs(hidden, head, ids, 0.7, chunk_tokens=chunk)
        (logp + 0.1 * entropy).sum().backward()

    return measured_peak(step)


def test_chunked_logprobs_peak_memory_is_bounded_by_the_chunk_not_the_tokens() -> None:
    vocab = 4096
    whole = 512 * vocab * 4  # one fp32 [tokens, vocab] logits tensor
    chunk = 32 * vocab * 4
    # Beside the chunk's buffers: the head's gradient ([vocab, 32] fp32) and [tokens] vectors.
    others = vocab * 32 * 4 * 2 + 512 * 32 * 4 * 2 + 512 * 4 * 8
    chunked = logprobs_peak(512, 32, vocab)
    assert chunked <= 2 * chunk + others, (chunked, chunk)
    assert chunked < whole / 4
    # The same tokens unchunked hold the whole logits (at least once), and twice the tokens
    # chunked cost no more than the tokens' own vectors.
    assert logprobs_peak(512, 512, vocab) >= whole
    assert logprobs_peak(1024, 32, vocab) <= chunked + 1024 * 32 * 4 * 2 + 1024 * 4 * 8
