"""Starting the run's own Ray cluster (`runtime.address` None), with a real Ray."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from ray._common.utils import get_ray_address_file

from venusrl.runtime.cluster.ray_cluster import RayCluster
from venusrl.runtime.config import RuntimeConfig


@pytest.mark.timeout(120)  # without the fix it waits on the dead cluster for good
def test_a_one_node_cluster_starts_here_past_the_address_file_a_killed_session_left() -> None:
    """A Ray session killed without `ray stop` leaves its address file naming a cluster that is
    gone; Ray's own default would wait on it for good (a run hung 10 minutes so). With no
    `runtime.address` the run starts its cluster here, as documented."""
    path = Path(get_ray_address_file(None))
    saved = path.read_text() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("192.0.2.2:40603")  # TEST-NET-1: nothing answers there
    t0 = time.monotonic()
    try:
        cluster = RayCluster(RuntimeConfig(kind="ray"))
        try:
            assert ray.is_initialized() and cluster.nodes()
            assert time.monotonic() - t0 < 60
        finally:
            cluster.shutdown()
    finally:
        if saved is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(saved)
