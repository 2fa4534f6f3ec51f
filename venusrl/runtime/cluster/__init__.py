"""The same roles on a Ray cluster (`runtime.kind: ray`).

The role code does not know about Ray. The coordinator runs in the driver as it does in one
process, and the trainer too, unless it has `trainer.world_size` > 1 ranks: those are actors in
one placement group (`trainer_actors.RayRanks`, driven by the same `RankedTrainer`). The rollout
side runs in `runtime.engines` rollout workers (`worker.RolloutWorker`), each an engine, a
sandbox pool and the agent loops of the groups placed on it, as one Ray actor. The driver sees
`fleet.RolloutFleet`, with the interfaces of the local roles: the coordinator's `Rollouts`, the
trainer's weight publisher, and single sandboxes.

A worker that dies costs the episodes that were on it, as infrastructure failures the coordinator
replaces or masks; the run goes on (`ray_cluster.Replicas` brings the worker back).
"""
