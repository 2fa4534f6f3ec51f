"""Every config in examples/ is valid as the code stands: examples must not rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from venusrl.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_example_configs() -> None:
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.run.steps >= 1
