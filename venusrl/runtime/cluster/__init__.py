"""The same roles on a Ray cluster (`runtime.kind: ray`).

The role code does not know about Ray. The coordinator and the trainer run in the driver as they
do in one process; the rollout side runs in `runtime.engines` rollout workers
(`workers.RolloutWorker`), each an engine, a sandbox pool and the agent loops of the groups placed
on it, as one Ray actor. The driver sees `workers.RolloutFleet`, with the interfaces of the local
roles: the coordinator's `Rollouts`, the trainer's weight publisher, and single sandboxes.

A worker that dies costs the episodes that were on it, as infrastructure failures the coordinator
replaces or masks; the run goes on (`ray_cluster.Replicas` brings the worker back).
"""
