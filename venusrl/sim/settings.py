"""`KEY=VALUE,...` lists from the command line: a policy's knobs (`venus[fill=0.8]`) and cost
model constants (`--cost gpu.pcie_h2d=inf`). Each caller types the values it knows."""

from __future__ import annotations


def key_values(text: str) -> dict[str, str]:
    """The settings of "KEY=VALUE,...", in order; ValueError names one that is not KEY=VALUE or a
    key set twice (the first would be lost without a word)."""
    found: dict[str, str] = {}
    for setting in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = (part.strip() for part in setting.partition("="))
        if not (key and eq and value):
            raise ValueError(f"{setting!r} is not KEY=VALUE")
        if key in found:
            raise ValueError(f"{key} set twice")
        found[key] = value
    return found
