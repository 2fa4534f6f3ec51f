"""A run checkpoints every `run.checkpoint_every` steps, or `run.checkpoint_every_s` seconds after
its last checkpoint when that comes first, and after its last step."""

from __future__ import annotations

from venusrl.runtime.checkpoint_schedule import CheckpointSchedule


def steps_checkpointed(schedule: CheckpointSchedule, ends_s: list[float]) -> list[int]:
    """The steps a checkpoint follows, step s ending at `ends_s[s]`."""
    saved = []
    for step, now_s in enumerate(ends_s):
        if schedule.due(step, now_s):
            schedule.saved(now_s)
            saved.append(step)
    return saved


def test_by_steps_only_every_nth_step_and_the_last_are_checkpointed() -> None:
    schedule = CheckpointSchedule(every_steps=3, last_step=7, every_s=None, saved_s=0.0)
    assert steps_checkpointed(schedule, [1000.0 * (s + 1) for s in range(8)]) == [2, 5, 7]


def test_a_step_ending_every_s_after_the_last_checkpoint_is_checkpointed() -> None:
    # Steps of 40 s, a checkpoint every 100 s of training: after steps 2 (120 s), 5 (240 s:
    # 120 s after the last), 8 (360 s); every 25 steps would have waited for step 24.
    schedule = CheckpointSchedule(every_steps=25, last_step=99, every_s=100.0, saved_s=0.0)
    assert steps_checkpointed(schedule, [40.0 * (s + 1) for s in range(10)]) == [2, 5, 8]


def test_the_time_counts_from_the_last_checkpoint_whichever_rule_wrote_it() -> None:
    # Step 1 is checkpointed by steps at 20 s: the next by time is at 20 + 50 s, not at 50 s.
    schedule = CheckpointSchedule(every_steps=2, last_step=99, every_s=50.0, saved_s=0.0)
    assert schedule.due(1, 20.0)
    schedule.saved(20.0)
    assert not schedule.due(2, 60.0)
    assert schedule.due(2, 70.0)


def test_a_resumed_run_counts_from_when_its_steps_began() -> None:
    # saved_s is when this run's steps began: a run resumed at 5,000 s waits every_s again.
    schedule = CheckpointSchedule(every_steps=25, last_step=99, every_s=300.0, saved_s=5000.0)
    assert not schedule.due(30, 5299.0) and schedule.due(30, 5300.0)
