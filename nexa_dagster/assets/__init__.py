"""The Nexa lifecycle as software-defined assets, one module per stage."""

# before any asset module's decorators run: the beta APIs the project chose knowingly warn no more
from nexa_dagster import dagster_warnings  # noqa: F401
