"""The documents keep up with the code: docs/configuration.md is what the config models give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_reference_is_what_the_config_models_give() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_config_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
