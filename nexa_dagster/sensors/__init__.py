"""Sensors that chain the lifecycle: retrain after a day's data lands, evaluate every new checkpoint once."""

from nexa_dagster.sensors.checkpoints import new_checkpoint_sensor
from nexa_dagster.sensors.retrain import retrain_after_ingest

SENSORS = [new_checkpoint_sensor, retrain_after_ingest]

__all__ = ["SENSORS", "new_checkpoint_sensor", "retrain_after_ingest"]
