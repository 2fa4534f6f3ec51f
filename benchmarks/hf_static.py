"""`transformers` `generate` in static, left-padded batches: how RL frameworks without a serving
engine sample, and so the baseline the engine benchmarks measure against (engine_throughput.py on
a CPU, engine_gpu.py on a GPU). A batch runs until its longest request is done; only the tokens
each request asked for count as useful, so the padding work is the baseline's cost."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


def without_early_stop(model: Any) -> Any:
    """Like `ignore_eos`: every requested token runs (no EOS stops a row or the batch)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def generate_static(
    model: Any, requests: Sequence[dict[str, Any]], batch_size: int, sample: bool, seed: int = 0
) -> dict[str, Any]:
    """`requests` ({"prompt_token_ids", "max_tokens"}) in order, `batch_size` at a time, on the
    model's device; greedy, or sampled at temperature 1 without truncation. Returns the elapsed
    time (the device synchronised at the end), the useful token count and each request's tokens."""
    device = model.device
    torch.manual_seed(seed)
    # Sampling untruncated, as the engine's requests: transformers' default top_k is 50.
    how: dict[str, Any] = {"do_sample": False}
    if sample:
        how = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            p = r["prompt_token_ids"]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(r["max_tokens"] for r in batch)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                **how,
            )
        outputs += [
            out[row, width : width + r["max_tokens"]].tolist() for row, r in enumerate(batch)
        ]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "elapsed_s": time.perf_counter() - start,
        "generated_tokens": sum(r["max_tokens"] for r in requests),
        "outputs": outputs,
    }
