"""Training: a readable DeepSpeed MoE training loop, run in its own process.

``job`` holds the JSON contract (``TrainingJob`` in, ``TrainingResult`` out), ``loop`` the Dagster-free loop, and
``worker`` the process entrypoint that the ``gpu_cluster`` resource (``resources/gpu_cluster/``) launches through Dagster Pipes.
"""
