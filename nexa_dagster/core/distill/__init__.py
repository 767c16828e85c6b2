"""Distillation: the teacher answers each document's prompt; SampleGate (heuristics, dedup, judge) keeps the good ones."""
