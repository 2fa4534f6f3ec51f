"""The environment service's config section (`sandbox.*`): the sandbox pool's budget and
admission."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from venusrl.sections import Section


class SandboxConfig(Section):
    """The sandbox pool of a run: what memory it may use and how sandboxes are admitted."""

    memory_budget_gib: float = Field(
        4.0, gt=0, description="memory the pool's sandboxes may use together (its cgroup limit)"
    )
    admission: Literal["footprint", "quota"] = Field(
        "footprint",
        description="admit by measured footprint, or by each sandbox's declared quota",
    )
    share_pages: bool = Field(
        True, description="fork a group's sandboxes from one warm zygote, sharing its pages"
    )
    image_cache_dir: str = Field(
        "/var/cache/venusrl/images",
        min_length=1,
        description="where container images' layers are unpacked, once, for every run on the"
        " machine (a filesystem with xattrs: ext4, xfs, btrfs)",
    )
    image_cache_gib: float = Field(
        50.0, gt=0, description="the layer cache's bound: unused layers are evicted past it"
    )
    registry_auth_file: str | None = Field(
        None,
        description="registry credentials, a Docker config.json (what `docker login` writes);"
        " none: pulls are anonymous",
    )
    insecure_registries: list[str] = Field(
        default_factory=list,
        description="registries (HOST[:PORT]) pulled from over plain HTTP (loopback ones are)",
    )
