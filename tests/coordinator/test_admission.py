"""Agent-level admission in the runtime: episodes wait for room in a window that follows the
engine's cache."""

from __future__ import annotations

import asyncio

from venusrl.coordinator.admission import AdmissionWindow
from venusrl.policy.agent_admission import AimdAdmission, CacheSignal

HEALTHY, THRASHING = CacheSignal(0.5, 0), CacheSignal(0.5, 4096)


def test_episodes_beyond_the_window_wait_until_one_ends() -> None:
    async def main() -> list[int]:
        window = AdmissionWindow(AimdAdmission(initial_window=2), lambda: asyncio.sleep(0))
        seen: list[int] = []

        async def episode() -> None:
            async with window.slot():
                seen.append(window.active)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(episode() for _ in range(6)))
        assert window.active == window.waiting == 0
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 6 and max(seen) == 2


def test_the_window_grows_while_the_cache_is_healthy_and_halves_when_it_thrashes() -> None:
    signals = [HEALTHY] * 3 + [THRASHING] + [CacheSignal(0.99, 0)]

    async def main() -> list[int]:
        windows: list[int] = []

        async def signal() -> CacheSignal:
            windows.append(window.window)
            return signals[len(windows) - 1] if len(windows) <= len(signals) else HEALTHY

        window = AdmissionWindow(AimdAdmission(initial_window=8, period_s=0.001), signal)
        control = asyncio.create_task(window.control())
        while len(windows) <= len(signals):
            await asyncio.sleep(0.001)
        control.cancel()
        return windows

    # +1 per healthy period; halved after re-prefill, halved again above the high-water mark.
    assert asyncio.run(main())[:6] == [8, 9, 10, 11, 5, 2]


def test_an_episode_held_back_when_the_window_shrinks_starts_once_load_falls() -> None:
    async def main() -> None:
        window = AdmissionWindow(AimdAdmission(initial_window=2), lambda: asyncio.sleep(0))
        release = asyncio.Event()
        started: list[int] = []

        async def episode(i: int) -> None:
            async with window.slot():
                started.append(i)
                await release.wait()

        first = [asyncio.create_task(episode(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        late = asyncio.create_task(episode(2))
        await asyncio.sleep(0.01)
        assert started == [0, 1] and window.waiting == 1
        release.set()
        await asyncio.gather(*first, late)
        assert started == [0, 1, 2]

    asyncio.run(main())
