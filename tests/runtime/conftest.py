"""A warm start made once for the runs that are not about it."""

from __future__ import annotations

import asyncio

import pytest

from tests.runtime import SMALL
from venusrl.config import load_config
from venusrl.runtime.train import train


@pytest.fixture(scope="session")
def warm_started_small(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`SMALL` begun from its warm-started policy, made once (16 demonstrations played in
    sandboxes, a tokenizer learnt from them, an epoch of imitation: the same policy each run's
    own warm start would write) instead of by every run: the `start-model/` of a one-step run,
    given as the run's model, with no warm start of its own."""
    run = tmp_path_factory.mktemp("warm-start")
    asyncio.run(train(load_config(None, [*SMALL, "run.steps=1"]), run))
    return [*SMALL, f"model={run / 'start-model'}", "run.warm_start_episodes=0"]
