"""Environments by reference, so a run can train on the user's own task family.

`rollout.env` (and each `rollout.mix` entry) names one of three things:

    treasure_hunt                      a built-in environment, by name
    my_tasks.envs:Countdown            a class in an importable module
    path/to/countdown.py:Countdown     a class in a Python file (relative to the current directory)

The class must subclass `Environment` and give everything the abstract class leaves open: `name`,
`template`, `instructions`, `tools`, `tasks` and `reward` (`examples/custom_env/` is one to copy).
A file is loaded the way Python runs a script, with its own directory on `sys.path`, so it may
import the modules beside it. On Ray each rollout worker loads the reference again (it validates
the run's config), so the file, or the package, must be at the same place on every node.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from venusrl.envs.builtin import BUILTIN
from venusrl.envs.environment import Environment, Tool
from venusrl.envs.types import TemplateSpec

_FORMS = "a built-in name, 'package.module:Class' or 'path/to/file.py:Class'"


def environment_class(reference: str) -> type[Environment]:
    """The environment class `reference` names; `ValueError` saying what is wrong otherwise."""
    if reference in BUILTIN:
        return BUILTIN[reference]
    where, colon, attribute = reference.rpartition(":")
    if not colon or not where or not attribute.isidentifier():
        raise ValueError(
            f"{reference!r} is neither a built-in environment ({', '.join(sorted(BUILTIN))})"
            f" nor a reference to a class: give {_FORMS}"
        )
    module = _load_file(Path(where)) if where.endswith(".py") else _import(where)
    cls = getattr(module, attribute, None)
    if cls is None:
        raise ValueError(f"{reference!r}: {where} has no attribute {attribute!r}")
    _check_class(reference, cls)
    return cls


def canonical_reference(reference: str, directory: Path | None = None) -> str:
    """`reference` as it should be stored: a file path made absolute (a relative one is taken
    from `directory`, by default the current one), so that a run resumed from elsewhere
    (`config.yaml` in the run directory) loads the same file."""
    where, _, attribute = reference.rpartition(":")
    if where.endswith(".py"):
        return f"{((directory or Path.cwd()) / where).resolve()}:{attribute}"
    return reference


def _import(module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # the user's module-level code may do anything
        raise ValueError(f"cannot import {module_name}: {type(e).__name__}: {e}") from None


def _load_file(path: Path) -> object:
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"{path} is not a file (a relative path is read from {Path.cwd()})")
    # One module per file, named after its path: loading it twice gives the same classes.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"venusrl_env_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module  # before running it, as an import would (dataclasses need it)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ValueError(f"loading {path} failed: {type(e).__name__}: {e}") from None
    return module


def _check_class(reference: str, cls: object) -> None:
    """What a run needs of the class, checked before anything starts."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{reference!r} is {cls!r}, not a subclass of venusrl Environment")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"{reference!r} leaves abstract methods unimplemented: {missing}")
    problems = []
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("`name` must be a non-empty str")
    elif name in BUILTIN and BUILTIN[name] is not cls:
        problems.append(f"`name` {name!r} is a built-in environment's; choose another")
    if not isinstance(getattr(cls, "template", None), TemplateSpec):
        problems.append("`template` must be a venusrl.envs.types.TemplateSpec")
    if not isinstance(getattr(cls, "instructions", None), str):
        problems.append("`instructions` (the system prompt) must be a str")
    tools = getattr(cls, "tools", None)
    if not isinstance(tools, tuple) or not all(isinstance(t, Tool) for t in tools):
        problems.append("`tools` must be a tuple of venusrl.envs.environment.Tool")
    elif len({t.name for t in tools}) < len(tools):
        problems.append("two `tools` have one name (the model could call only the first)")
    fields = getattr(cls, "reference_fields", None)
    if fields is not None and not (
        isinstance(fields, tuple) and all(isinstance(f, str) and f for f in fields)
    ):
        problems.append("`reference_fields` must be None or a tuple of field names")
    optional = getattr(cls, "optional_fields", None)
    if not (isinstance(optional, tuple) and all(isinstance(f, str) and f for f in optional)):
        problems.append("`optional_fields` must be a tuple of field names")
    for method in ("reset", "step", "reward"):
        if not inspect.iscoroutinefunction(getattr(cls, method)):
            problems.append(f"`{method}` must be an async method")
    for method in ("tasks", "demonstrator", "reference_problem"):
        if not isinstance(inspect.getattr_static(cls, method), classmethod):
            problems.append(f"`{method}` must be a classmethod")
    if problems:
        raise ValueError(f"{reference!r}: " + "; ".join(problems))
