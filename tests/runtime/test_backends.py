"""A run against another project's server (`rollout.backend`) starts only where the server can
serve it, and with the run's own weights loaded. Shape checks against a stand-in server (vLLM
0.32's replies, as a real one gave them); `test_vllm_backend.py` trains against a real vLLM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.conftest import StandIn
from tests.engine.test_backend_clients import vllm_completion, vllm_server_info
from venusrl.config import load_config
from venusrl.model.directory import init_model_dir
from venusrl.runtime.engines import served_engines
from venusrl.types import SamplingParams, TurnMeta


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    # Untied: vLLM cannot reload a tied output head (VllmEngine.check).
    untied = {"tie_word_embeddings": False}
    return init_model_dir(tmp_path / "model", preset="micro", overrides=untied, seed=0)


def test_training_against_vllm_without_its_development_routes_stops_before_it_starts(
    stand_in: StandIn, model_dir: Path
) -> None:
    """The weights reach vLLM through a development route: without VLLM_SERVER_DEV_MODE=1 the
    run would train and never update the sampler, so it does not start."""
    cfg = load_config(None, ["rollout.backend=vllm", f"run.engine_url={stand_in.url}"])
    with pytest.raises(ValueError, match=r"(?s)rollout.backend=vllm: .*VLLM_SERVER_DEV_MODE=1"):
        asyncio.run(served_engines(cfg, model_dir, 0))


def test_starting_against_vllm_loads_the_runs_weights_and_later_turns_carry_their_version(
    stand_in: StandIn, model_dir: Path
) -> None:
    stand_in.replies["/server_info?config_format=json"] = vllm_server_info(
        "processed_logprobs", "priority", 1024
    )
    stand_in.replies["/collective_rpc"] = lambda body: (200, {"results": [None]})
    stand_in.replies["/update_weight_version"] = lambda body: (200, {"success": True})
    stand_in.replies["/v1/completions"] = vllm_completion
    cfg = load_config(None, ["rollout.backend=vllm", f"run.engine_url={stand_in.url}"])

    async def start_and_turn() -> list[int]:
        engine = await served_engines(cfg, model_dir, 7)
        try:
            out = await engine.generate([1, 2], SamplingParams(), TurnMeta())
            return out.weight_versions
        finally:
            await engine.close()

    assert asyncio.run(start_and_turn()) == [7, 7]
    rpc = dict(stand_in.requests)["/collective_rpc"]
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
    assert dict(stand_in.requests)["/update_weight_version"] == {"new_version": "7"}
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert dict(stand_in.requests)["/v1/completions"]["stop_token_ids"] == [eos]
