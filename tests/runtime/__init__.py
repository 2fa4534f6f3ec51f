"""Tests of `venusrl train`, in one process and on Ray."""

# A run small enough for the default suite: 3 steps of 2 groups of 2, a 16-episode warm start.
SMALL = [
    "run.steps=3",
    "rollout.group_size=2",
    "rollout.batch_groups=2",
    "rollout.max_tokens_per_turn=24",
    "engine.threads=1",
    "run.warm_start_episodes=16",
    "run.warm_start_epochs=1",
]

NAMESPACE = "venusrl-test"  # of the actors of the Ray tests
