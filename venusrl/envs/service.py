"""What a run needs of a sandbox service: the local `SandboxPool`; on a Ray cluster the rollout
workers (`runtime.cluster.fleet.RolloutFleet`) make single sandboxes for the warm start, and
each runs its groups on a pool of its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from venusrl.envs.environment import SandboxHandle
from venusrl.envs.types import TemplateSpec

__all__ = ["GroupHandle", "SandboxHandle", "SandboxService", "SandboxSource"]


class GroupHandle(Protocol):
    """A group's sandboxes: forked from one warm zygote, on one machine."""

    async def add(self) -> SandboxHandle: ...

    def set_priority(self, priority: int) -> None:
        """Its members, waiting or running, rank at `priority` from now on (a re-rank)."""
        ...

    async def close(self) -> None: ...


class SandboxSource(Protocol):
    """Templates and single sandboxes; a template is a prepared one's name, or a spec that is
    prepared the first time it is asked for (a task's own image)."""

    async def prepare_template(self, spec: TemplateSpec) -> None: ...

    async def create(
        self,
        template: str | TemplateSpec,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> SandboxHandle: ...

    def sandboxes_running(self) -> int: ...


class SandboxService(SandboxSource, Protocol):
    """Single sandboxes, and groups forked from one zygote."""

    async def open_group(
        self,
        template: str | TemplateSpec,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> GroupHandle: ...
