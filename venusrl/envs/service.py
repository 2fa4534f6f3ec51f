"""What the coordinator needs of a sandbox service: the local `SandboxPool`, or the pools of a
cluster behind `runtime.cluster.ClusterPool`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from venusrl.envs.environment import SandboxVerbs
from venusrl.envs.types import TemplateSpec


class SandboxHandle(SandboxVerbs, Protocol):
    async def close(self) -> None: ...


class GroupHandle(Protocol):
    """A group's sandboxes: forked from one warm zygote, on one machine."""

    async def add(self) -> SandboxHandle: ...

    async def close(self) -> None: ...


class SandboxService(Protocol):
    async def prepare_template(self, spec: TemplateSpec) -> None: ...

    async def create(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> SandboxHandle: ...

    async def open_group(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> GroupHandle: ...

    def sandboxes_running(self) -> int: ...
