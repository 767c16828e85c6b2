"""Launching work off this machine: the worker command lines, Slurm scripts and job arrays, Kubernetes pods and
indexed Jobs, and the packaging shard task a cluster element runs. Plain functions of plain values (no Dagster):
the GPU-cluster resource (``nexa_dagster/resources/gpu_cluster/``) submits what they build."""
