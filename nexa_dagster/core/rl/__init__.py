"""Online RL's own parts, Dagster-free: the reward functions (``rewards.py``) and the checkable tasks (``tasks.py``).

The GRPO objective that trains on them is an objective of the one training loop (``core/training/grpo.py``).
"""
