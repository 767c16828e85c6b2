"""The project's own tiny models (no model can be downloaded here): a bootstrap for the demo and the tests, used
only where a configured model path asks for it (``nexa-dagster tiny-models``). Nothing in the pipeline imports it."""
