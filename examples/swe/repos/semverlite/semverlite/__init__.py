"""Semantic versions: parse, compare, sort, bump."""

from semverlite.version import InvalidVersion, Version, max_satisfying

__all__ = ["InvalidVersion", "Version", "max_satisfying"]
