"""Models trained by the project (Dagster-free). Checkpoints are exported as Hugging Face Mixtral directories."""
