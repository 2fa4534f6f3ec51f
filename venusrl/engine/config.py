"""The rollout engine's config section (`engine.*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from venusrl.sections import Section, torch_device
from venusrl.types import WeightUpdate


class EngineConfig(Section):
    """The rollout engine: paged KV cache, radix prefix cache, continuous batching."""

    device: str = Field("cpu", description="torch device of the model and the device KV tier")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="model and KV dtype; fp32 on CPU (bf16 decode is ~2x slower there)"
    )
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "torch",
        description="paged attention: torch (gathers pages; any device), triton (reads pages in"
        " place; CUDA; its kernels are tested in Triton's interpreter, not yet on a GPU, so"
        " it is opt-in); auto: triton on CUDA when it imports, else torch",
    )
    page_size: int = Field(
        8, ge=1, le=1024, description="tokens per KV page (only whole pages are shared)"
    )
    device_kv_pages: int = Field(
        4096, ge=2, description="pages in the device tier (page 0 is reserved as padding)"
    )
    host_kv_pages: int = Field(
        0, ge=0, description="pages in the host tier, where evicted KV is offloaded"
    )
    retention: Literal["lru", "trajectory"] = Field(
        "trajectory",
        description="which idle KV leaves the device first and whether it is offloaded or"
        " dropped (policy.kv_retention): lru drops the least recently used; trajectory keeps"
        " the KV of trajectories waiting on a tool and offloads it rather than drop it",
    )
    layer_residency: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="pressure (KV pages high-priority requests need / device pages) at which"
        " their completed pages keep only a band of their layers on device (half, a quarter"
        " further up, ...) and read the rest from the host tier layer by layer"
        " (policy.layer_residency; needs host_kv_pages); None: off",
    )
    max_running: int = Field(256, ge=1, description="most requests decoded in one batch")
    cuda_graphs: bool = Field(
        False,
        description="replay pure decode steps from CUDA graphs, one per batch-size bucket"
        " (engine/decode_graphs.py; untested on a GPU so far); off CUDA the same padded"
        " buffers run eagerly",
    )
    token_budget: int = Field(
        2048, ge=1, description="most tokens (decode + prefill chunks) in one forward pass"
    )
    max_context: int | None = Field(
        None, ge=1, description="context limit; defaults to the model's max_position_embeddings"
    )
    prefix_cache: bool = Field(True, description="reuse KV of shared prefixes (radix tree)")
    salt_cache_by_version: bool = Field(
        True,
        description="key cached KV by the weight version its trajectory started under: a new"
        " trajectory never reads KV that older weights computed, one in flight keeps its own",
    )
    weight_update: WeightUpdate = Field(
        "keep",
        description="how new weights load: keep (between two steps; requests in flight keep"
        " their KV and go on, their later tokens recording the new version, and trajectories"
        " between turns keep theirs), flush (keep, then drop every cached KV no running request"
        " holds, as vLLM's reset_prefix_cache and SGLang's flush_cache after an update) or drain"
        " (the requests in flight first run to the end of their turn, none admitted); flush and"
        " drain are the baselines of benchmarks/weight_update.py",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None leaves torch's")
    seed: int = Field(0, ge=0, description="seed of requests that give none")

    _device = field_validator("device")(torch_device)
