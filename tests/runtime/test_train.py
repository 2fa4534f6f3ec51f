"""`venusrl train` runs the whole loop in one process and accounts for every step."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from venusrl.config import load_config
from venusrl.runtime.local import train

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

SMALL = [
    "run.steps=3",
    "rollout.group_size=2",
    "rollout.batch_groups=2",
    "rollout.max_tokens_per_turn=24",
    "engine.threads=1",
]


@pytest.mark.parametrize("staleness", [0, 1])
def test_train_writes_one_metrics_line_per_step_within_the_staleness_bound(
    tmp_path: Path, staleness: int
) -> None:
    cfg = load_config(None, [*SMALL, f"rollout.max_staleness={staleness}"])
    metrics = asyncio.run(train(cfg, tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == metrics
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert [m["weight_version"] for m in lines] == [1, 2, 3]
    for m in lines:
        for key in ("reward_mean", "staleness_mean", "groups", "infra_failures", "masked"):
            assert key in m
        assert m["groups"] == 2 and 0 <= m["staleness_mean"] <= staleness
    assert (tmp_path / "config.yaml").exists()
