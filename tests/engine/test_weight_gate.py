"""`WeightGate`: a served backend that cannot tag tokens with their weights never samples a
request across a weight update, so the one version recorded for its tokens is the true one."""

from __future__ import annotations

import asyncio

import pytest

from venusrl.engine.weight_gate import WeightGate


def test_an_update_waits_for_turns_in_flight_and_holds_back_turns_that_come_after_it() -> None:
    events: list[str] = []

    async def run() -> None:
        gate = WeightGate(version=3)
        release = asyncio.Event()

        async def turn(name: str, wait: asyncio.Event | None = None) -> None:
            async with gate.generating() as version:
                events.append(f"{name} starts at v{version}")
                if wait is not None:
                    await wait.wait()
            events.append(f"{name} ends")

        async def update() -> None:
            async with gate.updating(4):
                events.append("update loads")

        in_flight = asyncio.create_task(turn("a", release))
        await asyncio.sleep(0)
        updating = asyncio.create_task(update())
        await asyncio.sleep(0)
        later = asyncio.create_task(turn("b"))  # arrives while the update waits: goes after it
        await asyncio.sleep(0.01)
        assert events == ["a starts at v3"]
        release.set()
        await asyncio.gather(in_flight, updating, later)
        assert gate.version == 4

    asyncio.run(run())
    assert events == ["a starts at v3", "a ends", "update loads", "b starts at v4", "b ends"]


def test_a_failed_update_leaves_the_old_version_and_lets_turns_go_on() -> None:
    async def run() -> int:
        gate = WeightGate(version=3)
        with pytest.raises(RuntimeError):
            async with gate.updating(4):
                raise RuntimeError("the server could not load the directory")
        async with gate.generating() as version:
            return version

    assert asyncio.run(asyncio.wait_for(run(), 5)) == 3
