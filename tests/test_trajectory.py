"""The trajectory record's own bookkeeping."""

from __future__ import annotations

import copy
import dataclasses
import pickle

from venusrl.types import Trajectory


def test_model_tokens_count_the_model_s_turns_in_a_record_however_it_was_made() -> None:
    traj = Trajectory.start("t0", "g0", "p0", [1, 2, 3])
    assert traj.model_tokens == 0
    traj.add_model_turn([4, 5], [-0.1, -0.2], [0, 0])
    traj.add_observation([6, 7, 8])
    traj.add_model_turn([9], [-0.3], [1])
    assert traj.model_tokens == 3 == sum(traj.mask)
    assert traj.progress().tokens == 3
    # Relayed from a rollout worker, copied, or built from its lists: the same count.
    rebuilt = Trajectory(
        "t0", "g0", "p0", traj.token_ids, traj.mask, traj.logprobs, traj.versions,
        traj.turn_starts,
    )  # fmt: skip
    for other in (pickle.loads(pickle.dumps(traj)), copy.deepcopy(traj), rebuilt):
        assert other.model_tokens == 3 and other == traj
    assert dataclasses.replace(traj, reward=1.0).model_tokens == 3
