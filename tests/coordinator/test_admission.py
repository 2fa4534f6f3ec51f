"""Agent-level admission in the runtime: episodes wait for room in a window that follows the
engine's cache; turns wait for a place in the KV window, most critical first."""

from __future__ import annotations

import asyncio
import contextlib

from venusrl.coordinator.admission import AdmissionWindow, TurnWindow
from venusrl.policy.agent_admission import AimdAdmission, CacheSignal
from venusrl.policy.critical_groups import BEST_EFFORT, HIGH
from venusrl.policy.kv_window import CriticalWindow

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
        assert window.waits == 4  # the episodes held back are counted, once each
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


# --- the KV window, turn by turn (rollout.admission=critical) -----------------------------------

KV = 1000  # the engine's device KV, tokens: a budget of 850


def one_engine(leave_after_calls: float = 1e4) -> TurnWindow:
    """As `venusrl train` runs it on one engine. Until it has seen a tool call return, the
    median call it assumes is `TurnRates`' 0.5 s."""
    return TurnWindow(CriticalWindow(leave_after_calls=leave_after_calls), [KV])


def test_a_turn_waits_while_the_kv_window_is_full_and_the_most_critical_goes_first() -> None:
    async def main() -> list[str]:
        window = one_engine()
        window.set_ranking({"g-critical": HIGH, "g-other": BEST_EFFORT})
        await window.enter("a", "g-other", 800)  # alone: admitted at once
        admitted: list[str] = []

        async def turn(tid: str, gid: str) -> None:
            await window.enter(tid, gid, 300)
            admitted.append(tid)

        waiting = [
            asyncio.create_task(turn("b", "g-other")),
            asyncio.create_task(turn("c", "g-critical")),
        ]
        await asyncio.sleep(0.01)
        assert admitted == [] and len(window.waiting) == 2
        window.end("a")  # 0 used: both fit, the critical one first
        await asyncio.wait_for(asyncio.gather(*waiting), 1.0)
        assert window.load == 600 and window.members == 2
        return admitted

    assert asyncio.run(main()) == ["c", "b"]


def test_a_member_in_a_long_tool_call_gives_its_place_to_a_waiting_trajectory() -> None:
    async def main() -> None:
        window = one_engine(leave_after_calls=0.04)  # 0.02 s
        window.set_ranking({"g": BEST_EFFORT})
        await window.enter("a", "g", 600)
        window.turn_done("a")  # its tool call starts
        b = asyncio.create_task(window.enter("b", "g", 600))
        await asyncio.sleep(0.005)
        assert not b.done()  # a's tool wait is still short: a keeps its place
        await asyncio.wait_for(b, 1.0)
        assert window.members == 1 and window.load == 600
        a = asyncio.create_task(window.enter("a", "g", 700))  # back from its tool: it waits
        await asyncio.sleep(0.01)
        assert not a.done()
        window.end("b")
        await asyncio.wait_for(a, 1.0)

    asyncio.run(main())


def test_a_member_leaves_after_a_multiple_of_the_median_tool_call_the_window_saw() -> None:
    async def main() -> None:
        window = one_engine(leave_after_calls=4)
        window.set_ranking({"g": BEST_EFFORT})
        assert window.book.rates.tool_s_per_turn == 0.5  # none seen yet: 2 s
        for _ in range(3):  # tool calls of 50 ms: a member leaves after 0.2 s
            await window.enter("a", "g", 100)
            window.turn_done("a")
            await asyncio.sleep(0.05)
        assert 0.05 <= window.book.rates.tool_s_per_turn < 0.25
        await window.enter("a", "g", 100)
        window.turn_done("a")  # a call of the tail begins
        await asyncio.sleep(0.08)
        assert window.members == 1  # 0.08 s: within four median calls
        await asyncio.sleep(1.0)
        assert window.members == 0 and window.load == 0

    asyncio.run(main())


def test_a_member_yields_at_its_turn_to_a_more_critical_trajectory_with_no_room() -> None:
    async def main() -> None:
        window = one_engine()
        window.set_ranking({"g-critical": HIGH, "g-other": BEST_EFFORT})
        await window.enter("a", "g-other", 500)
        window.turn_done("a")
        c = asyncio.create_task(window.enter("c", "g-critical", 500))
        await asyncio.sleep(0.01)
        assert not c.done()
        a = asyncio.create_task(window.enter("a", "g-other", 520))  # its next turn: it yields
        await asyncio.wait_for(c, 1.0)
        assert window.book.pauses == 1 and not a.done()
        window.end("c")
        await asyncio.wait_for(a, 1.0)

    asyncio.run(main())


def test_a_turn_cancelled_while_waiting_leaves_no_place_behind() -> None:
    async def main() -> None:
        window = one_engine()
        await window.enter("a", "g", 800)
        b = asyncio.create_task(window.enter("b", "g", 800))
        await asyncio.sleep(0.01)
        b.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await b
        window.end("a")
        assert window.waiting == {} and window.members == 0

    asyncio.run(main())
