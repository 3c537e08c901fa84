"""The training room: RL maths, the replay buffer, the trainer backends (torch, Megatron)."""
