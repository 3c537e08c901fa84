"""The vocabulary every room shares, on the ground floor: nothing here imports a room
above it (torchtitan's ``protocols/`` is the model).

- ``topology``: clusters, bundles, priorities, the cluster shape;
- ``snapshot``: the planner's contract (its input and its plan);
- ``cadence``: when to plan, shared by the coordinator and the simulator;
- ``cache_ref``: what names a cached weight version, and the layout it is packed with;
- ``messages``: the coordinator's wire protocol (drivers, workers, the CLI);
- ``generation``: a router's requests to a shard's data plane;
- ``engine``: the inference engine a shard worker drives (ShardEngine, AdapterEngine);
- ``hooks``: the hooks a training loop calls (PipelineHooks);
- ``sinks``: where synced weights land (WeightSink) and sync errors.
"""
