"""The native routes, for trainers and agent loops (token ids in, token ids out):

GET  /health          200 once the model is loaded, with the engine's load
GET  /stats           the engine's counters: cache hits, re-prefills, offloads, busy time
POST /generate        token ids + the turn's metadata -> tokens, logprobs, weight versions
                      (and `top_logprobs`: [token id, logprob] pairs, when asked)
POST /end_trajectory  no request of this trajectory follows: its KV may go
POST /update_weights  load a safetensors directory into the running engine
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from venusrl.engine.native_wire import (
    EndTrajectoryBody,
    EndTrajectoryReply,
    GenerateBody,
    GenerateReply,
    Health,
    UpdateWeightsBody,
    UpdateWeightsReply,
)
from venusrl.model.architecture import ModelConfigError
from venusrl.server.errors import ApiError
from venusrl.server.served import Served, served, unless_disconnected

router = APIRouter()
Model = Annotated[Served, Depends(served)]


@router.get("/health")
async def health(model: Model) -> Health:
    """Also the engine's load, read between its steps' bookkeeping (plain counts)."""
    engine = model.engine
    return Health(
        status="ok",
        weight_version=engine.weight_version,
        running=len(engine.running),
        waiting=len(engine.waiting),
        free_device_kv_pages=engine.cache.kv.device_pages.num_free,
        free_host_kv_pages=engine.cache.kv.host_pages.num_free,
        device_kv_tokens=engine.cache.kv.device_pages.capacity * engine.cache.page_size,
    )


@router.get("/stats")
async def stats(model: Model) -> dict[str, int | float]:
    return await model.runner.call(lambda e: e.counters())


@router.post("/generate")
async def generate(body: GenerateBody, request: Request, model: Model) -> GenerateReply:
    try:
        params = body.sampling_params.params()
    except ValueError as e:
        raise ApiError(400, f"sampling_params: {e}", "sampling_params") from None
    work = model.run(body.input_ids, params, body.meta(), body.request_id)
    return GenerateReply.of(await unless_disconnected(request, work))


@router.post("/end_trajectory")
async def end_trajectory(body: EndTrajectoryBody, model: Model) -> EndTrajectoryReply:
    await model.runner.call(lambda e: e.end_trajectory(body.trajectory_id))
    return EndTrajectoryReply(trajectory_id=body.trajectory_id)


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsBody, model: Model) -> UpdateWeightsReply:
    path = Path(body.path)
    if not path.is_absolute():
        raise ApiError(
            400,
            f"path {body.path!r} is relative: give an absolute path (the server's working "
            "directory is not the client's)",
            "path",
        )
    if not path.is_dir():
        raise ApiError(400, f"path {body.path!r} is not a directory", "path")
    try:
        version = await model.runner.call(
            lambda e: e.update_weights(path, body.version, body.flush_cache)
        )
    except ModelConfigError as e:
        raise ApiError(400, str(e), "path") from None
    except Exception as e:  # unreadable or corrupt files: nothing was loaded
        raise ApiError(400, f"cannot load weights from {body.path!r}: {e}", "path") from None
    return UpdateWeightsReply(weight_version=version)
