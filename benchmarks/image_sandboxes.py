"""SWE sandboxes in their images: ours (the group forks from one zygote on the image's Python) vs
a cold start per member vs podman (runc, --network=none: the runtime peers use), side by side on
one image, same machine, same run.

  group    K sandboxes of a new task's image, each with a warm Python that ran the task's setup
           (its tools' imports), in a pool that served a task before: seconds until all K ran a
           command, and physical memory per member (the template's zygote, with the page cache
           its start read, and the members, over K; podman: the containers' cgroups and their
           conmon monitors, over K). Runs alternate (A B C D, A B C D).
  density  on one memory budget, SWE sandboxes that each hold a test run's working set, held at
           once with no OOM kill: ours (footprint admission), quota admission (the declared
           memory), podman (containers under a parent cgroup of the budget, started until the
           kernel's first OOM kill)
  cache    the first pull of an image (unpacking its layers) vs a start from the warm cache, and
           the layer cache's bytes for the example's tasks, which share their base, against the
           sum of their images

The image is the SWE example's (examples/swe/build.py builds it when missing: mmdebstrap).
Prints one JSON object.

    python benchmarks/image_sandboxes.py [--k 8] [--repeats 3] [--budget-gib 4] [--hold-mib 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from venusrl.envs import SandboxPool, TemplateSpec
from venusrl.envs.cgroups import V1_ROOT, Cgroup, detect_version
from venusrl.envs.templates import IMAGE_ID_BASE
from venusrl.images.store import ImageStore

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30
SETUP = "import json, re, subprocess, sys\nimport pytest\n"  # what SWE tools import
COMMAND = "git status --short && python3 -c 'import sys'"
PODMAN = ["podman", "--runtime", "runc"]
PODMAN_RUN = ["run", "-d", "--network=none", "--ulimit", "nofile=20000:20000", "--ulimit",
              "nproc=32768:32768"]  # fmt: skip
# podman's sandbox keeps a warm Python too: the same imports, then it waits for its commands.
KEEP_WARM = (
    "python3 -c 'import json, re, subprocess, sys; import pytest; import time; time.sleep(1e6)'"
)


def example_image() -> tuple[str, Path, list[str]]:
    """The SWE example's first task's image (built if missing), its layout, all its tasks' refs."""
    layout = ROOT / "examples/swe/build/images"
    if not (layout / "index.json").exists():
        subprocess.run([sys.executable, str(ROOT / "examples/swe/build.py")], check=True)
    index = json.loads((layout / "index.json").read_text())
    tags = [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]]
    refs = [f"oci:{layout}:{tag}" for tag in tags]
    return refs[0], layout, refs


def _spec(ref: str, name: str) -> TemplateSpec:
    return TemplateSpec(
        name=name,
        image=ref,
        setup=SETUP,
        workdir="/testbed",
        declared_memory_bytes=2 * GiB,
        expected_memory_bytes=64 * MiB,
    )


# --- group start -------------------------------------------------------------------------------


async def ours(
    ref: str, cache: Path, k: int, share_pages: bool, trial: int, warm: bool = False
) -> dict[str, float]:
    """One group of K; `warm`: its template already up (a second task of the same image, as
    SWE-smith's and R2E-Gym's tasks share an image per repository), not timed."""
    # A budget no run here reaches: the cold baseline reserves its declared 2 GiB per member
    # until it has seen one finish, and none finishes before all K are up.
    images = ImageStore(cache, 64 * GiB, IMAGE_ID_BASE)
    pool = SandboxPool(20 * GiB, share_pages=share_pages, images=images, admission_timeout_s=60)
    async with pool:
        await pool.images.get(ref)  # pulled and unpacked already: the start is what is timed
        # A pool that has served a task before (its launcher up), as in a run: what a group
        # of a new task's image then costs is what is timed.
        await pool.prepare_template(_spec(ref, "earlier-task"))
        spec = _spec(ref, f"g{trial}")
        if warm:
            await pool.prepare_template(spec)
        start = time.perf_counter()
        group = await pool.open_group(spec)
        members = await asyncio.gather(*(group.add() for _ in range(k)))
        results = await asyncio.gather(*(m.exec(COMMAND, timeout_s=60) for m in members))
        took = time.perf_counter() - start
        assert all(r.ok for r in results), [r.text() for r in results if not r.ok][:1]
        await asyncio.sleep(0.5)  # settle: what they hold, not what starting them touched
        held = [m.usage().physical_bytes for m in members]
        total = pool.template_memory_bytes(spec.name) + sum(held)
        private = statistics.mean(held)
        await group.close()
    return {"seconds": took, "memory_per_member_mib": total / k / MiB, "private_mib": private / MiB}


def _podman(*args: str, check: bool = True) -> str:
    out = subprocess.run([*PODMAN, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}: {out.stderr.strip()}")
    return out.stdout.strip()


def _container_memory(container: str) -> int:
    """The container's cgroup charge and its conmon monitor's proportional set size."""
    info = json.loads(_podman("inspect", container))[0]
    cgroup = info["State"].get("CgroupPath", "")
    if detect_version() == 1:
        path = V1_ROOT / "memory" / cgroup.strip("/") / "memory.usage_in_bytes"
    else:
        path = Path("/sys/fs/cgroup") / cgroup.strip("/") / "memory.current"
    charged = int(path.read_text())
    conmon = info["State"].get("ConmonPid", 0)
    pss = 0
    if conmon:
        for line in Path(f"/proc/{conmon}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return charged + pss


async def _podman_async(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *PODMAN, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"podman {args[0]}: {err.decode().strip()}")
    return out.decode().strip()


async def podman(image: str, k: int) -> dict[str, float]:
    async def one(i: int) -> str:
        container = await _podman_async(*PODMAN_RUN, "-w", "/testbed", image, "sh", "-c", KEEP_WARM)
        await _podman_async("exec", container, "sh", "-c", COMMAND)
        return container

    start = time.perf_counter()
    containers = await asyncio.gather(*(one(i) for i in range(k)))
    took = time.perf_counter() - start
    await asyncio.sleep(0.5)
    total = sum(_container_memory(c) for c in containers)
    _podman("rm", "-f", "-t", "0", *containers)
    return {"seconds": took, "memory_per_member_mib": total / k / MiB}


def podman_image(layout: Path, tag: str) -> str:
    name = f"localhost/venusrl-bench:{tag.lower()}"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{layout}:{tag}", f"containers-storage:{name}"],
        check=True,
    )
    return name


def group_start(ref: str, layout: Path, cache: Path, k: int, repeats: int) -> dict[str, Any]:
    image = podman_image(layout, ref.rsplit(":", 1)[1])
    runs: dict[str, list[dict[str, float]]] = {
        "ours": [],
        "ours_warm": [],
        "cold": [],
        "podman": [],
    }
    for trial in range(repeats):  # A B C D, A B C D: drift hits all alike
        runs["ours"].append(asyncio.run(ours(ref, cache, k, True, trial)))
        runs["ours_warm"].append(asyncio.run(ours(ref, cache, k, True, trial, warm=True)))
        runs["cold"].append(asyncio.run(ours(ref, cache, k, False, trial)))
        runs["podman"].append(asyncio.run(podman(image, k)))
    med = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    return {
        "k": k,
        "median": med,
        "start_speedup_vs_podman": med["podman"]["seconds"] / med["ours"]["seconds"],
        "start_speedup_vs_cold": med["cold"]["seconds"] / med["ours"]["seconds"],
        "warm_template_speedup_vs_podman": med["podman"]["seconds"] / med["ours_warm"]["seconds"],
        "memory_vs_podman": med["ours"]["memory_per_member_mib"]
        / med["podman"]["memory_per_member_mib"],
        "memory_vs_cold": med["ours"]["memory_per_member_mib"]
        / med["cold"]["memory_per_member_mib"],
        "pairs": {
            "speedup_vs_podman": [
                p["seconds"] / o["seconds"]
                for o, p in zip(runs["ours"], runs["podman"], strict=True)
            ]
        },
    }


# --- density -----------------------------------------------------------------------------------

# A test run's working set, written (so it is resident) and held.
HOLD = "python3 -c 'import time; x = b\"x\" * {n}; time.sleep(1e6)' >/dev/null 2>&1 &"


async def density_ours(
    ref: str, cache: Path, budget: int, hold: int, admission: str, most: int
) -> dict[str, Any]:
    """Sandboxes of one task each hold `hold` bytes; ask for `most` of them, each as soon as
    the previous runs: how many are held at once, and whether the kernel killed any."""
    store = ImageStore(cache, 64 * GiB, IMAGE_ID_BASE)
    async with SandboxPool(
        budget, admission=admission, images=store, admission_timeout_s=20
    ) as pool:  # type: ignore[arg-type]
        group = await pool.open_group(_spec(ref, f"density-{admission}"))
        held = []
        for _ in range(most):
            try:
                sb = await asyncio.wait_for(group.add(), 20)
            except Exception:
                break  # admission would not take another: the pool is full
            await sb.exec(HOLD.format(n=hold), timeout_s=30)
            await asyncio.sleep(0.3)  # the pages land, admission sees them
            held.append(sb)
        await asyncio.sleep(1.0)
        stats = pool.stats()
        alive = sum(sb.alive for sb in held)
        await group.close()
    return {"held": alive, "oom_kills": stats.oom_kills, "preemptions": stats.preemptions}


def density_podman(image: str, budget: int, hold: int, most: int) -> dict[str, Any]:
    """Containers under a parent cgroup of the budget, each --memory=2g as the task declares,
    started until the kernel kills one (a container that stops running: podman admits
    nothing, and a limit hit in the parent is no OOM event of the container's own)."""
    parent = Cgroup("venusrl-bench-podman", detect_version())
    parent.create()
    parent.limit(budget, None, None)
    containers: list[str] = []
    held, killed = 0, 0
    try:
        for _ in range(most):
            command = HOLD.format(n=hold).removesuffix(" &")
            cgroup = f"/{parent.rel}"
            run = [*PODMAN_RUN, "--memory", "2g", "--cgroup-parent", cgroup, image, "sh", "-c"]
            containers.append(_podman(*run, command))
            time.sleep(0.5)  # its working set lands
            states = [json.loads(_podman("inspect", c))[0]["State"] for c in containers]
            killed = sum(not state["Running"] for state in states)
            if killed:
                break
            held = len(containers)
    finally:
        if containers:
            _podman("rm", "-f", "-t", "0", *containers, check=False)
        parent.remove()
    return {"held_before_first_kill": held, "killed": killed, "started": len(containers)}


def density(ref: str, layout: Path, cache: Path, budget: int, hold: int) -> dict[str, Any]:
    most = int(budget / hold) + 4
    image = podman_image(layout, ref.rsplit(":", 1)[1])
    out = {
        "budget_gib": budget / GiB,
        "hold_mib": hold / MiB,
        "ours": asyncio.run(density_ours(ref, cache, budget, hold, "footprint", most)),
        "quota": asyncio.run(density_ours(ref, cache, budget, hold, "quota", most)),
        "podman": density_podman(image, budget, hold, most),
    }
    out["ours_vs_quota"] = out["ours"]["held"] / max(1, out["quota"]["held"])
    out["ours_vs_podman"] = out["ours"]["held"] / max(1, out["podman"]["held_before_first_kill"])
    return out


# --- the layer cache -------------------------------------------------------------------------


async def first_and_cached(ref: str, cache: Path) -> dict[str, float]:
    async def start() -> float:
        async with SandboxPool(8 * GiB, images=ImageStore(cache, 64 * GiB, IMAGE_ID_BASE)) as pool:
            t = time.perf_counter()
            sb = await pool.create(_spec(ref, "first"))
            assert (await sb.exec(COMMAND, timeout_s=60)).ok
            return time.perf_counter() - t

    shutil.rmtree(cache, ignore_errors=True)
    first = await start()
    cached = await start()
    return {"first_start_s": first, "cached_start_s": cached, "first_over_cached": first / cached}


def cache_bytes(refs: list[str], cache: Path) -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    store = ImageStore(cache, 64 * GiB, IMAGE_ID_BASE)
    images = [store.pull(ref) for ref in refs]
    unshared = sum(
        json.loads(Path(f"{layer}.json").read_text())["disk_bytes"]
        for im in images
        for layer in im.layers
    )
    shared = store.cache.stats().disk_bytes
    return {
        "tasks": len(refs),
        "cache_mib": shared / MiB,
        "unshared_mib": unshared / MiB,
        "saved": 1 - shared / unshared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--hold-mib", type=int, default=150)
    parser.add_argument("--sections", default="group,density,cache")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("sandboxes and podman need root")
    ref, layout, refs = example_image()
    out: dict[str, Any] = {"image": ref}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        cache = Path(tmp) / "cache"
        ImageStore(cache, 64 * GiB, IMAGE_ID_BASE).pull(ref)
        sections = args.sections.split(",")
        if "group" in sections:
            out["group_start"] = group_start(ref, layout, cache, args.k, args.repeats)
        if "density" in sections:
            out["density"] = density(
                ref, layout, cache, int(args.budget_gib * GiB), args.hold_mib * MiB
            )
        if "cache" in sections:
            out["cache"] = asyncio.run(first_and_cached(ref, Path(tmp) / "fresh"))
            out["cache"] |= cache_bytes(refs, Path(tmp) / "tasks")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
