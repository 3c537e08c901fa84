"""The rollout room: what a pipeline generates and how it is scored.

Tasks (prompts and rewards on token ids), the collector that keeps trajectory
groups in flight within the staleness bound. Datasets, reward functions and
environments loaded by path, and multi-turn episodes, land here.
"""
