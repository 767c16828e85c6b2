"""Whether the schedule and the sensors start running when the daemon first sees them (``NEXA_AUTOMATION``).

On by default: a deployment's nightly retrain and its sensors must run without anyone turning them on. Off (``make
ui AUTOMATION=off``) lets a person look at an instance without the daemon starting runs at once. Dagster applies a
default status only while the instance holds no state for that schedule or sensor: one turned on or off in the UI
(or with ``dagster sensor start|stop``) stays as it was set.
"""

from __future__ import annotations

import dagster as dg

from nexa_dagster import settings


def automation_on() -> bool:
    """``NEXA_AUTOMATION`` is not ``off`` (a typo fails the load rather than silently running everything)."""
    value = settings.AUTOMATION.get().strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{settings.AUTOMATION.name}={value!r}: expected on or off")
    return value == "on"


def sensor_default_status() -> dg.DefaultSensorStatus:
    return dg.DefaultSensorStatus.RUNNING if automation_on() else dg.DefaultSensorStatus.STOPPED


def schedule_default_status() -> dg.DefaultScheduleStatus:
    return dg.DefaultScheduleStatus.RUNNING if automation_on() else dg.DefaultScheduleStatus.STOPPED
