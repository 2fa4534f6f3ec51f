"""A warm start made once for the runs that are not about it; a Ray cluster of two nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.runtime import NAMESPACE, SMALL
from venusrl.config import load_config
from venusrl.runtime.train import train

if TYPE_CHECKING:  # Ray is imported by the Ray tests only
    from ray.cluster_utils import Cluster


@pytest.fixture(scope="session")
def warm_started_small(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`SMALL` begun from its warm-started policy, made once (16 demonstrations played in
    sandboxes, a tokenizer learnt from them, an epoch of imitation: the same policy each run's
    own warm start would write) instead of by every run: the `start-model/` of a one-step run,
    given as the run's model, with no warm start of its own."""
    run = tmp_path_factory.mktemp("warm-start")
    asyncio.run(train(load_config(None, [*SMALL, "run.steps=1"]), run))
    return [*SMALL, f"model={run / 'start-model'}", "run.warm_start_episodes=0"]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    """A real Ray cluster of two nodes (two raylets on this machine), one CPU each."""
    import ray  # only for the Ray tests
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 256 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
