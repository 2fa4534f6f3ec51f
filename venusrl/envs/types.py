"""The sandbox vocabulary every backend and environment shares: templates, results, failures.

A sandbox is a handful of verbs (create, exec, files, fork, close); pools, admission and warm
templates are built on top of them. Failures are typed by who is to blame: an `InfraFailure` is the
platform's fault (the sandbox was preempted, crashed or could not start) and the caller may retry
it with a replacement; everything the sandboxed program does wrong comes back as an `ExecResult`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from venusrl.images.oci import ImageError
from venusrl.images.reference import parse_ref

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class TemplateSpec:
    """What every sandbox of a template starts from.

    `setup` is Python source run once in the template's warm interpreter (the zygote) before any
    sandbox is forked from it: imports, data, tool functions. Its globals are the globals that
    `Sandbox.run_python` sees. `files` seed the workspace (relative path -> content). Setup is the
    environment author's code, trusted like the rest of the training job; model output never runs
    there.

    `image` roots the sandboxes in a container image instead of this machine's /usr and Python
    (`venusrl.images.reference`: `oci:DIR`, `docker-archive:FILE`, `NAME:TAG` from a registry):
    the whole image is writable, copy-on-write, and `workspace_bytes` bounds what is written.
    Its config's Env, WorkingDir and User apply; `workdir` and `user` override the last two.
    The setup then runs on the image's own Python (an image without one takes no setup).
    Templates of one `family` (a dataset's tasks, an image each) share what admission learns
    of their memory.

    `declared_memory_bytes` is what the sandbox says it may use: quota admission reserves exactly
    that, and it is also the sandbox's hard memory limit (its own cgroup). Footprint admission
    reserves the measured footprint plus a learned growth estimate instead. Until it has learned
    one, it reserves `expected_memory_bytes` for a sandbox forked from the warm template (what the
    sandbox adds to the template's pages), or the declared memory when that is not given.
    """

    name: str
    setup: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)
    declared_memory_bytes: int = 1 * GiB
    expected_memory_bytes: int | None = None
    max_pids: int = 256
    cpus: float = 1.0
    workspace_bytes: int = 256 * MiB
    tmp_bytes: int = 64 * MiB
    setup_timeout_s: float = 120.0
    env: Mapping[str, str] = field(default_factory=dict)
    image: str | None = None
    workdir: str | None = None
    user: str | None = None
    family: str | None = None

    @property
    def estimates(self) -> str:
        """Whose memory estimates admission learns and reads for this template: its family's
        (the tasks of one dataset, each with an image of its own, are alike), or its own."""
        return self.family or self.name

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"template name must be letters, digits, - or _, got {self.name!r}")
        for key, low in (
            ("declared_memory_bytes", 16 * MiB),
            ("workspace_bytes", 1 * MiB),
            ("tmp_bytes", 1 * MiB),
        ):
            if getattr(self, key) < low:
                raise ValueError(f"TemplateSpec.{key} must be >= {low}, got {getattr(self, key)}")
        expected = self.expected_memory_bytes
        if expected is not None and not 0 < expected <= self.declared_memory_bytes:
            raise ValueError(
                "TemplateSpec.expected_memory_bytes must be in (0, declared_memory_bytes], "
                f"got {expected}"
            )
        if self.max_pids < 4:
            raise ValueError(f"TemplateSpec.max_pids must be >= 4, got {self.max_pids}")
        if not 0 < self.cpus <= 64:
            raise ValueError(f"TemplateSpec.cpus must be in (0, 64], got {self.cpus}")
        if self.image is not None:
            try:
                parse_ref(self.image)
            except ImageError as e:
                raise ValueError(f"TemplateSpec.image: {e}") from None
        elif self.workdir is not None or self.user is not None:
            raise ValueError("TemplateSpec.workdir and user are for a template with an image")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise ValueError(f"TemplateSpec.workdir must be absolute, got {self.workdir!r}")


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # 128 + signal number when a signal ended the command (as a shell reports it)
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    # stdout or stderr went over max_output_bytes; the rest was dropped (and `exec` stopped there)
    truncated: bool = False
    oom_killed: bool = False  # the kernel killed it because the sandbox hit its memory limit
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """stdout then stderr, decoded leniently: what a model sees as a tool observation."""
        out = self.stdout.decode(errors="replace") + self.stderr.decode(errors="replace")
        if self.timed_out:
            out += "\n[timed out]"
        if self.oom_killed:
            out += "\n[killed: out of memory]"
        if self.truncated:
            out += "\n[output truncated]"
        return out


@dataclass(frozen=True)
class SandboxUsage:
    physical_bytes: int  # what the sandbox's own memory cgroup is charged: its private pages
    peak_physical_bytes: int
    pids: int


class SandboxError(Exception):
    """A request was wrong (bad path, file too big, sandbox closed): the caller's fault."""


class InfraFailure(SandboxError):
    """The platform failed the caller; retry with a replacement sandbox."""


class SandboxStartError(InfraFailure):
    pass


class SandboxCrashed(InfraFailure):
    pass


class SandboxPreempted(InfraFailure):
    """The pool killed this sandbox to keep memory under its high-water mark."""


class SandboxExpired(InfraFailure):
    """The sandbox outlived its TTL."""


class AdmissionTimeout(InfraFailure):
    """No room was found for the sandbox within the pool's admission timeout."""
