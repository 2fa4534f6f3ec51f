"""Sandboxes need root (namespaces, cgroups, mounts); CI runs as root."""

from __future__ import annotations

import os

import pytest

requires_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the local sandbox backend needs root (namespaces, cgroups)"
)
