"""The scale preset a run uses, as Dagster resource config: seen and changed where a person launches the run.

``scale_preset`` appears in the Launchpad (``resources: scale_preset: config: name: small``) and in
``dagster job launch --config``, with ``NEXA_SCALE`` (read when the code location loads, default ``tiny``) as its
default, so schedules and sensors, which pass no config, keep using the environment's preset. Dagster records the
resolved value with the run; the assets put the preset's name in their metadata.
"""

from __future__ import annotations

import dagster as dg
from pydantic import ConfigDict, Field, field_validator

from nexa_dagster.core.common.config import (
    ConfigError,
    ScalePreset,
    config_dir,
    load_deepspeed_config,
    load_scale,
    scale_name,
)


class ScaleResource(dg.ConfigurableResource):
    """``configs/scales/<name>.yaml``: the same recipe at tiny, small or full size (``load()`` reads it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="scale preset: a file configs/scales/<name>.yaml (tiny, small, full, ...); "
        "default: NEXA_SCALE where the code location runs"
    )

    @field_validator("name")
    @classmethod
    def _a_preset_file(cls, name: str) -> str:
        """A name with no preset file fails where it is given (the load, the launch), naming the file looked for."""
        check_preset_name(name)
        return name

    @classmethod
    def from_env(cls) -> ScaleResource:
        """The default of every run: ``NEXA_SCALE`` (``tiny`` when unset)."""
        try:
            return cls(name=check_preset_name(scale_name()))
        except ValueError as e:
            raise ConfigError(f"NEXA_SCALE: {e}") from None

    def load(self) -> ScalePreset:
        return load_scale(self.name)

    def deepspeed_config(self) -> dict:
        """The DeepSpeed file the preset names (``configs/deepspeed/<deepspeed_config>``), as a dict."""
        return load_deepspeed_config(self.load().deepspeed_config)


def check_preset_name(name: str) -> str:
    """``name`` when ``configs/scales/<name>.yaml`` exists, else a ``ValueError`` naming that file and the presets."""
    directory = config_dir() / "scales"
    if not (directory / f"{name}.yaml").is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
        raise ValueError(f"scale preset {name!r}: no file {directory / f'{name}.yaml'} (presets: {known})")
    return name
