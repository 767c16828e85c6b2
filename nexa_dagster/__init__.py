"""nexa-dagster: the Nexa LLM lifecycle as one orchestrated, observable, resumable Dagster graph.

The package has two halves:

* ``nexa_dagster.core`` is Dagster-free: data, distillation, packing, model, training, evaluation and serving logic
  as plain functions and classes that a notebook can import.
* ``nexa_dagster.assets`` / ``resources`` / ``jobs`` / ``sensors`` wire that core into Dagster
  (``nexa_dagster.definitions`` holds the one ``Definitions`` object).
"""

__version__ = "0.1.0"
