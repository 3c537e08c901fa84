"""A planner snapshot in the documented JSON format (docs/SCHEDULING.md), for tests."""

EXAMPLE = """
{"cluster": {"nodes": 1, "gpus_per_node": 4},
 "pipelines": [
  {"id": "A",
   "clusters": {"actor_train": {"tp": 1, "devices": [0, 1]},
                "actor_infer": {"tp": 1, "devices": [0, 1, 2, 3]}},
   "active_ranks": {"actor_infer": [0]},
   "progress": {"target": 100, "completed": 50},
   "requests": [{"seq": 7, "cluster": "actor_train", "priority": "ACTOR_TRAINING"}]},
  {"id": "B",
   "clusters": {"actor_infer": {"tp": 1, "devices": [0, 1, 2, 3]}},
   "requests": [{"seq": 8, "cluster": "actor_infer", "priority": "GENERATION",
                 "step_target_estimate": 64}]}]}
"""
