"""The run's in-process engine as the runtime drives it (`runtime/engines.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import write_hf_model
from venusrl.config import load_config
from venusrl.model.architecture import ModelConfigError
from venusrl.model.directory import iter_safetensors
from venusrl.runtime.engines import LocalEngine
from venusrl.types import SamplingParams, TurnMeta


def test_a_draining_engine_whose_new_weights_are_refused_takes_new_turns_again(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """`engine.weight_update=drain` holds admission while the turns in flight end; a load that
    fails (a set that leaves a weight out: refused before anything is copied) must not leave
    the engine closed to new turns."""
    other = write_hf_model(tmp_path / "other", "qwen3", seed=5, head_dim=16)
    short = [(k, v) for k, v in iter_safetensors(other) if "norm" not in k]
    cfg = load_config(None, ["engine.weight_update=drain", "engine.threads=1"])

    async def main() -> int:
        engine = LocalEngine(tiny_qwen3, cfg, 0)
        try:
            with pytest.raises(ModelConfigError):
                await engine.load_weights(short, 1)
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            out = await asyncio.wait_for(engine.generate([1, 2, 3], params, TurnMeta()), 30)
            return len(out.token_ids)
        finally:
            await engine.close()

    assert asyncio.run(main()) == 4


def test_the_engines_version_is_the_last_load_that_completed_what_staleness_counts_from(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """The coordinator counts a group's staleness from the version the engine holds: while new
    weights are on their way (the trainer already at the next version) or after a load that was
    refused, it is still the old one."""
    other = write_hf_model(tmp_path / "other", "qwen3", seed=5, head_dim=16)
    whole = list(iter_safetensors(other))
    short = [(k, v) for k, v in whole if "norm" not in k]
    cfg = load_config(None, ["engine.threads=1"])

    async def main() -> list[int]:
        engine = LocalEngine(tiny_qwen3, cfg, 3)
        seen = [engine.version]
        try:
            with pytest.raises(ModelConfigError):
                await engine.load_weights(short, 4)
            seen.append(engine.version)
            loading = asyncio.ensure_future(engine.load_weights(whole, 4))
            seen.append(engine.version)  # on its way: not held yet
            await loading
            seen.append(engine.version)
            return seen
        finally:
            await engine.close()

    assert asyncio.run(main()) == [3, 3, 3, 4]
