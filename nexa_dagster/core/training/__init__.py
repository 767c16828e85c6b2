"""Training: a readable DeepSpeed MoE training loop run in its own process (``worker.py``)."""
