"""Packaging: blends of samples and documents become training data (packed SFT Parquet, Megatron bin/idx, JSONL),
sharded, parallel, resumable from receipts and reused night after night from a content-addressed store."""
