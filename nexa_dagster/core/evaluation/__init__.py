"""Evaluation: the frozen eval set, the evaluation worker, paired statistics, benchmarks, and the promotion gate."""
