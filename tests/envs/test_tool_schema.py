"""A tool's schema from a Python function: what the model is shown and what its calls are
checked against come from the function's annotations and docstring."""

from __future__ import annotations

from typing import Literal

import pytest

from venusrl.envs.environment import Tool


def write_file(
    path: str, content: str, mode: int, append: bool, lines: list[int], ratio: float
) -> str:
    """Write a file in the workspace.

    Args:
        path: relative to the workspace root
        content: the whole new content,
            kept as written
        mode: permission bits
        append: add to the end instead
        lines: line numbers to touch
        ratio: how much
    """
    return path


def search(
    query: str, limit: int = 10, kind: Literal["code", "docs"] = "code", note: str | None = None
) -> str:
    """Search the index.

    A longer explanation that is part of the description.

    Args:
        query (str): what to look for
        limit: at most this many hits

    Returns:
        The hits, one a line.
    """
    return query


def test_a_functions_annotations_and_docstring_become_its_tool_schema() -> None:
    tool = Tool.from_function(search)
    assert (tool.name, tool.description, tool.run) == (
        "search",
        "Search the index. A longer explanation that is part of the description.",
        None,
    )
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "default": 10, "description": "at most this many hits"},
            "kind": {"type": "string", "enum": ["code", "docs"], "default": "code"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        },
        "required": ["query"],
    }


def test_the_schema_agrees_with_transformers_get_json_schema_on_plain_types() -> None:
    from transformers.utils import get_json_schema

    theirs = get_json_schema(write_file)
    del theirs["function"]["return"]  # the model is not shown what a tool returns
    assert {"type": "function", "function": Tool.from_function(write_file).schema()} == theirs


def test_calls_of_a_function_tool_are_checked_against_its_annotations() -> None:
    tool = Tool.from_function(search)
    assert tool.argument_problem({"query": "x", "limit": 5}) is None
    assert tool.argument_problem({"query": "x", "limit": "5"}) == (
        "argument 'limit' must be integer, got a string"
    )
    assert tool.argument_problem({"limit": 5}) == "missing required argument 'query'"


def test_a_function_without_a_docstring_or_with_star_args_is_refused_by_name() -> None:
    def bare(x: int) -> int:
        return x

    def many(*xs: int) -> int:
        """Add."""
        return sum(xs)

    with pytest.raises(ValueError, match="tool function bare needs a docstring"):
        Tool.from_function(bare)
    with pytest.raises(ValueError, match=r"tool function many: \*xs cannot be called"):
        Tool.from_function(many)
