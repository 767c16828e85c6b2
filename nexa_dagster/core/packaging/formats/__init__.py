"""On-disk formats packaging writes and training reads: split manifests of packed Parquet shards, Megatron bin/idx."""
