"""An engine in another process: `venusrl serve`, or any server that speaks its `/generate`
(token ids in; token ids, logprobs and weight versions out) and `/update_weights`; `GET /stats`
(the engine's counters) is optional. `JsonEndpoint` is the HTTP under it and under the clients
of other servers (`vllm_client.py`, `sglang_client.py`).

The agent loop and the trainer use it exactly like the in-process engine: `generate` has the
signature of `AsyncEngine.generate`. A request that fails (connection, 5xx, timeout) raises
`RemoteEngineError`, which the coordinator treats as an infrastructure failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from venusrl.engine.native_wire import (
    EndTrajectoryBody,
    GenerateBody,
    GenerateReply,
    Health,
    UpdateWeightsBody,
    UpdateWeightsReply,
)
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

Reply = TypeVar("Reply", bound=BaseModel)


class RemoteEngineError(RuntimeError):
    pass


class JsonEndpoint:
    """A server that answers JSON over HTTP."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        # No cap on connections: requests over httpx's default 100 would queue in the client,
        # first come first served, before the server sees their priorities.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=timeout_s, limits=limits
        )

    async def call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST `body` (GET without one); the reply's JSON (None for an empty reply), or
        RemoteEngineError saying why."""
        try:
            if body is None:
                r = await self._client.get(path)
            else:
                r = await self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise RemoteEngineError(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise RemoteEngineError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json() if r.content else None
        except ValueError:
            raise RemoteEngineError(f"{self.url}{path}: not JSON: {r.text[:200]!r}") from None

    async def close(self) -> None:
        await self._client.aclose()


class RemoteEngine:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url
        self._server = JsonEndpoint(url, api_key, timeout_s)

    async def _call(self, path: str, body: BaseModel, reply: type[Reply]) -> Reply:
        data = await self._server.call(path, body.model_dump(mode="json"))
        try:
            return reply.model_validate(data)
        except ValidationError as e:
            wrong = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'the reply'}: {err['msg']}"
                for err in e.errors()
            )
            raise RemoteEngineError(f"{path}: malformed reply: {wrong}") from None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta | None = None
    ) -> GenerationOutput:
        body = GenerateBody.of(prompt_ids, params, meta or TurnMeta(), None)
        return (await self._call("/generate", body, GenerateReply)).output(prompt_ids)

    async def end_trajectory(self, trajectory_id: str) -> None:
        """No request of this trajectory follows: the server may let its KV go."""
        await self._server.call(
            "/end_trajectory", EndTrajectoryBody(trajectory_id=trajectory_id).model_dump()
        )

    async def kv_capacity_tokens(self) -> int:
        """Tokens of KV the server's device pages hold (`GET /health`)."""
        data = await self._server.call("/health")
        try:
            return Health.model_validate(data).device_kv_tokens
        except ValidationError as e:
            raise RemoteEngineError(f"/health: malformed reply: {e.errors()[0]['msg']}") from None

    async def counters(self) -> dict[str, float]:
        """The server engine's totals since it started (`Engine.counters`)."""
        counts: dict[str, Any] = await self._server.call("/stats")
        return {str(k): v for k, v in counts.items()}

    async def update_weights(self, path: Path, version: int) -> int:
        """The server loads the safetensors directory `path` (it must see the same filesystem)."""
        body = UpdateWeightsBody(path=str(Path(path).resolve()), version=version)
        return (await self._call("/update_weights", body, UpdateWeightsReply)).weight_version

    async def close(self) -> None:
        await self._server.close()
