"""The package's layering, read from the source: every import points down.

Floors, bottom up; a role imports only from its own modules and from roles on lower floors. The
contract types and the other leaves import nothing of the package; the pure policies import only
each other. No two files import each other, directly or through others.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "venusrl"

FLOORS: list[set[str]] = [
    {"types", "sections", "workloads"},  # leaves: what crosses roles, config base, workloads
    {"policy"},  # pure decisions, shared by the engine and the simulator
    {"model"},  # the architecture, its files, tokenizer, weight streams, tool-call formats
    {"engine"},
    {"images"},  # container images: formats, the layer cache, pulls
    {"envs", "trainer"},
    {"rewards"},  # reward workers: an environment's reward, a reward service, a judge model
    {"coordinator"},
    {"sim", "server"},
    {"gateway"},  # an agent harness's model endpoint, recorded as episodes
    {"runtime"},  # with the composed config (`venusrl/config.py`), which is the run's input
    {"cli"},
]
LEAVES = {"types", "sections", "workloads"}


def role(module: str) -> str:
    """`venusrl.engine.kv_manager` -> `engine`; the top-level config belongs to the runtime."""
    name = module.split(".")[1]
    return "runtime" if name == "config" else name


def floor(name: str) -> int:
    return next(i for i, roles in enumerate(FLOORS) if name in roles)


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


KNOWN = {m for m, _ in modules()}


def imports(path: Path) -> set[str]:
    """The package's modules a file imports, anywhere in it (functions and TYPE_CHECKING
    blocks included: a lazy import is still an arrow)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from venusrl.envs import wire` imports a module
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in KNOWN else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name in KNOWN}


GRAPH = {module: imports(path) for module, path in modules()}


def test_every_role_has_a_floor() -> None:
    roles = {role(m) for m in GRAPH if m != "venusrl"}
    assert roles <= set().union(*FLOORS), roles - set().union(*FLOORS)


def test_the_leaves_and_the_policies_import_nothing_else_of_the_package() -> None:
    for module, imported in GRAPH.items():
        if module == "venusrl":
            continue
        if role(module) in LEAVES:
            assert not imported, f"{module} imports {sorted(imported)}"
        if role(module) == "policy":
            others = {m for m in imported if role(m) != "policy"}
            assert not others, f"{module} imports {sorted(others)}"


def test_every_import_points_down() -> None:
    upward = []
    for module, imported in GRAPH.items():
        if module == "venusrl":
            continue
        for other in imported:
            mine, theirs = role(module), role(other)
            if mine != theirs and floor(theirs) >= floor(mine):
                upward.append(f"{module} -> {other}")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_no_files_import_each_other() -> None:
    cycles = set()

    def visit(module: str, path: list[str]) -> None:
        for other in GRAPH.get(module, ()):
            if other in path:
                cycle = path[path.index(other) :]
                first = cycle.index(min(cycle))
                cycles.add(" -> ".join(cycle[first:] + cycle[:first]))
            elif other not in done:
                visit(other, [*path, other])
        done.add(module)

    done: set[str] = set()
    for module in GRAPH:
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))
