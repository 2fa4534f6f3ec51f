"""`venusrl train` against a real vLLM server (`rollout.backend=vllm`): vLLM's CPU build, which
`benchmarks/setup_vllm.sh` installs in `.venv-vllm/` (or the interpreter VENUSRL_VLLM_PYTHON
names). Slow: the server alone takes a minute or two to start on a small CPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from venusrl.config import load_config
from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.engine.vllm_client import VllmEngine
from venusrl.model.directory import init_model_dir
from venusrl.runtime.record import read_records
from venusrl.runtime.train import train
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> Path | None:
    """The interpreter of a venv where vLLM is installed, if there is one."""
    named = os.environ.get("VENUSRL_VLLM_PYTHON")
    python = Path(named) if named else REPO / ".venv-vllm" / "bin" / "python"
    venv = python.parent.parent
    if python.exists() and any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return python
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
    pytest.mark.skipif(
        vllm_python() is None,
        reason="no vLLM: run benchmarks/setup_vllm.sh (it makes .venv-vllm/), or point"
        " VENUSRL_VLLM_PYTHON at the python of a venv with vLLM",
    ),
]


@contextlib.contextmanager
def vllm_server(model: Path, log: Path, max_context: int) -> Iterator[str]:
    """`vllm serve` as a run needs it (VllmEngine.check), on one CPU; its URL."""
    python = vllm_python()
    assert python is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, through which weights are reloaded
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; its default takes most of the machine's memory
        "VLLM_CPU_OMP_THREADS_BIND": str(min(os.sched_getaffinity(0))),
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-model-len", str(max_context), "--scheduling-policy", "priority",
             "--logprobs-mode", "processed_logprobs", "--enable-prompt-tokens-details",
             "--seed", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            if server.poll() is not None:
                pytest.fail(f"vLLM exited with {server.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not start within 420 s:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_training_against_vllm_records_the_version_that_sampled_every_token(
    tmp_path: Path,
) -> None:
    """Three synchronous steps (max_staleness=0) against vLLM: each step trains tokens sampled
    by the weights it starts from, so the trainer's logprobs of them are vLLM's (ratio 1, no
    clipping), and at the end vLLM runs the last published weights."""
    untied = {"tie_word_embeddings": False}  # vLLM cannot reload a tied head (VllmEngine.check)
    model = init_model_dir(tmp_path / "model", preset="micro", overrides=untied, seed=0)
    with vllm_server(model, tmp_path / "vllm.log", max_context=1024) as url:
        overrides = [
            "rollout.env=tests.runtime.reply_parity:ReplyParity",
            "rollout.backend=vllm",
            f"run.engine_url={url}",
            "run.steps=3",
            "run.warm_start_episodes=0",
            "rollout.group_size=8",
            "rollout.batch_groups=2",
            "rollout.max_tokens_per_turn=24",
            "rollout.max_staleness=0",
            "rollout.max_context=1024",
            "trainer.updates_per_batch=1",
            # Large steps: a token labelled with the wrong version would have a ratio far from 1.
            "trainer.lr=1e-2",
        ]
        cfg = load_config(None, overrides, {"model": str(model)})
        metrics = asyncio.run(train(cfg, tmp_path / "run"))
        assert [m["weight_version"] for m in metrics] == [1, 2, 3]
        assert all(m["staleness_max"] == 0 and m["infra_failures"] == 0 for m in metrics)
        trained = [m for m in metrics if m["tokens"] > 0]  # a group's replies may all tie
        assert trained
        for m in trained:
            assert m["ratio_mean"] == pytest.approx(1, abs=2e-3) and m["clip_fraction"] == 0
        assert metrics[-1]["engine"]["weight_updates"] == 3  # one per step, counted since start
        assert metrics[-1]["engine"]["generated_tokens"] > 0
        # A group's members share their prompt in vLLM's prefix cache, within one version.
        assert metrics[-1]["engine"]["cached_prompt_tokens"] > 0

        # Each step's batch was sampled by the weights of the step before it, every token of it.
        records = list(read_records(tmp_path / "run"))
        assert {r["step"] for r in records} == {0, 1, 2}
        for r in records:
            assert set(r["versions"]) == {str(r["step"])}, r["versions"]

        # vLLM now runs the last published weights: its greedy turn is our engine's on them.
        published = tmp_path / "run" / "published" / "v3"
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        ours = Engine.from_model_dir(published, EngineConfig()).generate([prompt], greedy)[0]

        async def theirs() -> GenerationOutput:
            client = VllmEngine(url, [], version=3)
            try:
                return await client.generate(prompt, greedy, TurnMeta())
            finally:
                await client.close()

        out = asyncio.run(theirs())
        assert out.token_ids == ours.token_ids
        assert out.logprobs == pytest.approx(ours.logprobs, abs=1e-3)
    steps = [{k: m[k] for k in ("step", "tokens", "ratio_mean", "wall_s")} for m in metrics]
    print(json.dumps({"steps": steps, "engine": metrics[-1]["engine"]}))
