"""Async GRPO on time-shared devices: tasks, losses, replay buffer, trainer, pipeline."""
