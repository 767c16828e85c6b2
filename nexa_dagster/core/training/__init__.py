"""Training: a readable DeepSpeed MoE training loop, run in its own process.

``job`` holds the JSON contract (``TrainingJob`` in, ``TrainingResult`` out), ``loop`` the Dagster-free loop, and
``worker`` the process entrypoint that ``resources/gpu_cluster.py`` launches through Dagster Pipes.
"""
