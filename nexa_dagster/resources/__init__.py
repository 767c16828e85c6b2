"""One Dagster resource per outside thing: storage, LLM endpoints, the GPU cluster, experiment tracking."""
