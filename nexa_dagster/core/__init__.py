"""Dagster-free core of nexa-dagster: every function here runs from a notebook or a plain script."""
