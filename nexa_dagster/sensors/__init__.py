"""Sensors that chain the lifecycle: retrain after a day's data lands, evaluate every new checkpoint once, and
Dagster's automation condition sensor, which keeps the leaderboard fresh and evaluates each new base model (an
asset's automation condition is only evaluated while such a sensor runs), and one that makes Dagster's run
retries happen when its retry daemon skipped a failed run; and one that shows the serving service's canary and keeps
the MLflow alias with its promotion."""

import dagster as dg

from nexa_dagster.automation import sensor_default_status
from nexa_dagster.sensors.canary import canary_sensor
from nexa_dagster.sensors.checkpoints import new_checkpoint_sensor
from nexa_dagster.sensors.missed_retries import missed_run_retries
from nexa_dagster.sensors.preference import pairs_after_promotion, preference_training_after_pairs
from nexa_dagster.sensors.retrain import retrain_after_ingest

automation_sensor = dg.AutomationConditionSensorDefinition(
    "automation_sensor",
    target=dg.AssetSelection.assets("leaderboard", "base_model_eval"),
    default_status=sensor_default_status(),
    minimum_interval_seconds=30,
    description="Evaluates automation conditions: the leaderboard is rebuilt after new evaluation reports, and "
    "each new base model is evaluated once an eval set exists.",
)

SENSORS = [
    new_checkpoint_sensor,
    retrain_after_ingest,
    automation_sensor,
    pairs_after_promotion,
    preference_training_after_pairs,
    missed_run_retries,
    canary_sensor,
]

__all__ = [
    "SENSORS",
    "automation_sensor",
    "canary_sensor",
    "missed_run_retries",
    "new_checkpoint_sensor",
    "pairs_after_promotion",
    "preference_training_after_pairs",
    "retrain_after_ingest",
]
