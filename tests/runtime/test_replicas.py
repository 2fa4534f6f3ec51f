"""Which restartable actors are in service (`Replicas`), without a cluster."""

from __future__ import annotations

import asyncio

from venusrl.runtime.cluster.ray_cluster import ActorLost, Replicas


def test_a_late_failure_of_a_replaced_actor_does_not_take_its_successor_out_of_service() -> None:
    async def scenario() -> None:
        revived: list[int] = []

        async def revive(i: int) -> None:
            revived.append(i)

        replicas = Replicas(2, revive, max_restarts=3)
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


def test_an_actor_that_dies_again_while_being_revived_is_revived_again_and_counted() -> None:
    async def scenario() -> None:
        tries: list[int] = []

        async def revive(i: int) -> None:
            tries.append(i)
            if len(tries) == 1:  # Ray restarted it, and it died before it was back in service
                raise ActorLost("died while it waited for the next publish")

        replicas = Replicas(1, revive, max_restarts=3)
        replicas.up = {0}
        assert replicas.lost(0, 0)
        await asyncio.sleep(0.01)
        assert tries == [0, 0] and replicas.up == {0} and replicas.restarts == [2]

    asyncio.run(scenario())


def test_an_actor_out_of_restarts_stays_out_of_service() -> None:
    async def scenario() -> None:
        tries: list[int] = []

        async def revive(i: int) -> None:
            tries.append(i)
            raise ActorLost("died again")

        replicas = Replicas(2, revive, max_restarts=2)
        replicas.up = {0, 1}
        assert replicas.lost(0, 0)
        await asyncio.sleep(0.01)
        # Two restarts, each dying before it was back: the third death is its last.
        assert tries == [0, 0] and replicas.up == {1} and replicas.restarts == [3, 0]
        # Without restarts, one that dies is not waited for at all.
        never = Replicas(1, revive, max_restarts=0)
        never.up = {0}
        assert never.lost(0, 0)
        await asyncio.sleep(0.01)
        assert tries == [0, 0] and never.up == set() and never.restarts == [1]

    asyncio.run(scenario())
