"""The same roles on a Ray cluster (`runtime.kind: ray`).

The role code does not know about Ray: the coordinator, the agent loop and the trainer run in the
driver as they do in one process, and talk to two facades with the interfaces of their local
counterparts:

- `EngineFleet` (`engines.py`) stands where the in-process engine stands: N engine actors, a
  sticky router in front of them (`policy.placement`), weights published through Ray's object
  store, and an engine that died restarted, brought to the current weights and routed to again.
- `ClusterPool` (`sandboxes.py`) stands where the sandbox pool stands: one environment manager
  actor per node, each with the node's own pool; a group's sandboxes on one node, a new group on
  the node with the most admissible memory.

An actor that dies costs the trajectories that were on it, as infrastructure failures the
coordinator replaces or masks; the run goes on.
"""
