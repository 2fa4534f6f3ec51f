"""The environment service: sandboxes forked from warm templates, admitted by real footprint."""

from venusrl.envs.accounts import PoolStats, SandboxRecord
from venusrl.envs.environment import Environment, StepResult, Task, Tool
from venusrl.envs.pool import SandboxGroup, SandboxPool
from venusrl.envs.sandbox import Sandbox
from venusrl.envs.types import (
    AdmissionTimeout,
    ExecResult,
    InfraFailure,
    SandboxCrashed,
    SandboxError,
    SandboxExpired,
    SandboxPreempted,
    SandboxStartError,
    SandboxUsage,
    TemplateSpec,
)

__all__ = [
    "AdmissionTimeout",
    "Environment",
    "ExecResult",
    "InfraFailure",
    "PoolStats",
    "Sandbox",
    "SandboxCrashed",
    "SandboxError",
    "SandboxExpired",
    "SandboxGroup",
    "SandboxPool",
    "SandboxPreempted",
    "SandboxRecord",
    "SandboxStartError",
    "SandboxUsage",
    "StepResult",
    "Task",
    "TemplateSpec",
    "Tool",
]
