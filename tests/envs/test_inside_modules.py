"""The modules an image's own Python imports to be a zygote (`templates.INSIDE_MODULES`) keep to
what every image Python from 3.8 on can run: Python 3.8's grammar, the standard library, and each
other."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from venusrl.envs.templates import INSIDE_MODULES

ENVS = Path(__file__).resolve().parents[2] / "venusrl" / "envs"
# Names that exist only in Pythons newer than 3.8, which ruff's py38 target does not see.
NEWER = {
    "removeprefix",
    "removesuffix",
    "waitstatus_to_exitcode",
    "pidfd_open",
    "send_fds",
    "recv_fds",
}


@pytest.mark.parametrize("name", INSIDE_MODULES)
def test_an_inside_module_parses_as_python_3_8_and_imports_only_the_standard_library_and_its_peers(
    name: str,
) -> None:
    source = (ENVS / f"{name}.py").read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top == "venusrl":
                modules = {node.module.split(".")[-1]} | {a.name for a in node.names}
                assert modules & set(INSIDE_MODULES), f"{name} imports {node.module}"
                assert node.module in (
                    "venusrl.envs",
                    *(f"venusrl.envs.{m}" for m in INSIDE_MODULES),
                )
            else:
                assert top in sys.stdlib_module_names or top == "__future__", f"{name}: {top}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in sys.stdlib_module_names, f"{name}: {alias.name}"
        elif isinstance(node, ast.Attribute):
            assert node.attr not in NEWER, f"{name} uses {node.attr}, newer than Python 3.8"
        elif isinstance(node, ast.keyword):
            assert node.arg != "strict", f"{name}: zip(strict=) is Python 3.10"
