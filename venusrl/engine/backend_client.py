"""A served engine of another project (vLLM, SGLang) as our `Generate`: token ids in; token ids,
logprobs and the weight version out, weights loaded through the server's own endpoint from a
directory both processes can read. Each backend's file translates requests and replies
(`vllm_client.py`, `sglang_client.py`); what they share is here.

These servers do not say which weights sampled a token, so the version is ours: `WeightGate`
keeps updates and generation apart. They keep no KV per trajectory either: `end_trajectory` has
nothing to tell them, and `counters` are what this side saw (tokens, requests, update times).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from venusrl.engine.remote import JsonEndpoint, RemoteEngineError
from venusrl.engine.weight_gate import WeightGate
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta


class BackendClient(ABC):
    """What the two backends share; each says how to check its server, generate and load."""

    backend: ClassVar[str]  # the name users configure (`rollout.backend`), for messages

    def __init__(
        self,
        url: str,
        eos_token_ids: Sequence[int],
        version: int,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.url = url
        self.server = JsonEndpoint(url, api_key, timeout_s)
        # The model's own end of turn: a server started without its tokenizer knows no EOS.
        self.eos_token_ids = tuple(eos_token_ids)
        self.gate = WeightGate(version)
        self._counts: dict[str, float] = dict.fromkeys(
            (
                "requests",
                "prompt_tokens",
                "cached_prompt_tokens",
                "generated_tokens",
                "weight_updates",
                "weight_update_s",  # the server loading a directory
                "weight_update_wait_s",  # waiting for the turns in flight first (`WeightGate`)
            ),
            0.0,
        )

    @abstractmethod
    async def check(self, model: dict[str, Any], max_context: int, priorities: bool) -> None:
        """Refuse, before anything runs, a server that cannot serve the run of `model` (its
        config.json): too short a context, no priority scheduling where the run sends
        priorities, the wrong logprobs (RemoteEngineError saying how to start it)."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta | None = None
    ) -> GenerationOutput:
        async with self.gate.generating() as version:
            out = await self._generate(prompt_ids, params, meta or TurnMeta(), version)
        c = self._counts
        c["requests"] += 1
        c["prompt_tokens"] += len(prompt_ids)
        c["cached_prompt_tokens"] += out.cached_prompt_tokens
        c["generated_tokens"] += len(out.token_ids)
        return out

    async def update_weights(self, path: Path, version: int) -> int:
        """The server loads the model directory `path` (written whole: config and safetensors);
        tokens sampled from then on record `version`."""
        asked = time.monotonic()
        async with self.gate.updating(version):
            started = time.monotonic()
            await self._load(Path(path).resolve(), version)
        self._counts["weight_updates"] += 1
        self._counts["weight_update_s"] += time.monotonic() - started
        self._counts["weight_update_wait_s"] += started - asked
        return version

    async def end_trajectory(self, trajectory_id: str) -> None:
        """Nothing to tell: the server keeps no KV per trajectory."""
        return None

    async def counters(self) -> dict[str, float]:
        return dict(self._counts)

    async def close(self) -> None:
        await self.server.close()

    def stop_token_ids(self, params: SamplingParams) -> list[int]:
        eos = () if params.ignore_eos else self.eos_token_ids
        return sorted({*params.stop_token_ids, *eos})

    def malformed(self, path: str, error: Exception) -> RemoteEngineError:
        return RemoteEngineError(f"{self.url}{path}: malformed {self.backend} reply: {error!r}")

    @abstractmethod
    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta, version: int
    ) -> GenerationOutput:
        """One turn on the server, its tokens labelled `version` (the gate holds it)."""

    @abstractmethod
    async def _load(self, path: Path, version: int) -> None:
        """The server loads the model directory `path` through its own route."""
