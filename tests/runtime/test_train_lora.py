"""`venusrl train` with LoRA: checkpoints of merged weights with their adapters beside them, a
resume that trains on from the adapters, and (slow) the CPU example learning through them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tests.runtime import SMALL
from venusrl.config import load_config
from venusrl.model.directory import load_model
from venusrl.runtime.record import read_metrics
from venusrl.runtime.train import train

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

ROOT = Path(__file__).resolve().parents[2]
LORA = ["trainer.lora_rank=4", "trainer.lora_alpha=8", "run.checkpoint_every=1"]


def test_a_lora_run_checkpoints_merged_weights_and_resumes_from_its_adapters(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, [*SMALL, *LORA, "run.steps=2"])
    asyncio.run(train(cfg, tmp_path))
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    adapters = torch.load(checkpoint / "lora_adapters.pt", weights_only=True)
    assert adapters and all(k.endswith(("lora_A", "lora_B")) for k in adapters)
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if k.endswith("lora_B"))
    # The checkpoint's weights are a plain model, the random one the run began with plus what
    # the adapters learnt (in the warm start at least: two tiny RL steps may see no signal).
    merged, start = load_model(checkpoint), load_model(tmp_path / "initial-model")
    assert any(
        not torch.equal(a, b) for a, b in zip(merged.parameters(), start.parameters(), strict=True)
    )
    longer = load_config(tmp_path / "config.yaml", ["run.steps=3"])
    asyncio.run(train(longer, tmp_path, resume=True))
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2]


@pytest.mark.slow  # 9-10 min on 2 cores (a warm start for the base, then 150 LoRA steps)
@pytest.mark.timeout(1200)  # twice what it took, as its two runs share the default's 600 s
def test_the_lora_cpu_example_raises_the_reward_of_the_warm_started_policy(tmp_path: Path) -> None:
    """The example as its header runs it: the CPU example's warm start makes the base, then 150
    GRPO steps train LoRA adapters on it."""
    base = tmp_path / "base"
    asyncio.run(
        train(load_config(ROOT / "examples" / "cpu-treasure-hunt.yaml", ["run.steps=1"]), base)
    )
    example = ROOT / "examples" / "cpu-treasure-hunt-lora.yaml"
    cfg = load_config(example, [f"model={base / 'start-model'}"])
    metrics = asyncio.run(train(cfg, tmp_path / "lora"))
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.15  # the bar of the full-weight RL test, uncalibrated for LoRA
