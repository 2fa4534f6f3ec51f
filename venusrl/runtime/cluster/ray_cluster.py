"""Joining (or starting) the Ray cluster, and calling actors with our own error types."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError

from venusrl.config import RuntimeSection

T = TypeVar("T")


class ActorLost(RuntimeError):
    """The actor behind a call died (or is restarting): the work it held is gone."""


class RayCluster:
    """The cluster a run places its actors on. Joins `address`, or starts a one-node cluster
    here; a Ray session the caller already opened is used as it is (and left open)."""

    def __init__(self, cfg: RuntimeSection) -> None:
        self.cfg = cfg
        self._owned = not ray.is_initialized()
        if self._owned:
            ray.init(
                address=cfg.address,
                namespace=cfg.namespace,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )

    def nodes(self) -> list[str]:
        """The ids of the nodes that are alive, in a stable order (the head's first)."""
        alive = [n for n in ray.nodes() if n["Alive"]]
        head = ray.get_runtime_context().get_node_id()
        return sorted((n["NodeID"] for n in alive), key=lambda node: (node != head, node))

    def shutdown(self) -> None:
        if self._owned:
            ray.shutdown()


async def call(method: Any, *args: Any) -> Any:
    """`await actor.method.remote(*args)`, with the method's own exception re-raised as it is
    (a sandbox error stays a sandbox error) and a dead actor as `ActorLost`."""
    try:
        return await method.remote(*args)
    except RayTaskError as e:
        if isinstance(e.cause, BaseException):
            raise e.cause from None
        raise
    except RayActorError as e:
        raise ActorLost(str(e).splitlines()[0]) from e


async def until_alive(ping: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """Retry `ping` until the actor answers (Ray restarts it in the meantime)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await ping()
        except ActorLost:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
