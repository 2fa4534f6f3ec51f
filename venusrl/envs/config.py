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
