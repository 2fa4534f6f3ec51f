"""Which restartable actors are in service (`Replicas`), without a cluster."""

from __future__ import annotations

import asyncio

from venusrl.runtime.cluster.ray_cluster import ActorLost, Replicas


def test_a_late_failure_of_a_replaced_actor_does_not_take_its_successor_out_of_service() -> None:
    async def scenario() -> None:
        revived: list[int] = []

        async def revive(i: int) -> None:
            revived.append(i)

        replicas = Replicas(2, revive)
        replicas.up = {0, 1}
        epoch = replicas.restarts[1]  # two calls in flight on actor 1 when it dies
        assert replicas.lost(1, epoch)  # the first failure takes it out and brings it back
        assert replicas.up == {0}
        await asyncio.sleep(0.01)
        assert revived == [1] and replicas.up == {0, 1} and replicas.restarts == [0, 1]
        # The second failure, from the incarnation already replaced, arrives after the restart.
        assert not replicas.lost(1, epoch)
        assert replicas.up == {0, 1} and replicas.restarts == [0, 1]
        # A failure of the new incarnation counts.
        assert replicas.lost(1, replicas.restarts[1])
        assert replicas.restarts == [0, 2]

    asyncio.run(scenario())


def test_an_actor_out_of_restarts_stays_out_of_service() -> None:
    async def scenario() -> None:
        async def revive(i: int) -> None:
            raise ActorLost("no restarts left")

        replicas = Replicas(1, revive)
        replicas.up = {0}
        assert replicas.lost(0, 0)
        await asyncio.sleep(0.01)
        assert replicas.up == set() and replicas.restarts == [1]

    asyncio.run(scenario())
