"""The scale preset is run config: the Launchpad shows it with NEXA_SCALE as its default, a run launched with another
preset uses that preset (and says so in its metadata and its recorded config), and a bad name fails naming the file.

Before, the preset came from ``NEXA_SCALE`` inside each asset: a person launching a run could neither see nor change
it, and the run did not record it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import yaml
from support.sandbox import make_sandbox, materialize_command, sandbox_env

from nexa_dagster.core.common.config import REPO_ROOT

DAY = "2026-11-20"
TINY_CAP = yaml.safe_load((REPO_ROOT / "configs" / "scales" / "tiny.yaml").read_text())["max_docs_per_day"]


def _scale_in_schema(job: dg.JobDefinition) -> object:
    """What the Launchpad scaffolds for ``resources.scale_preset.config`` (its default)."""
    resources = job.run_config_schema.config_type.fields["resources"].config_type
    config = resources.fields["scale_preset"].config_type.fields["config"]
    return config.default_value if config.default_provided else None


def test_the_launchpad_shows_the_scale_preset_with_the_environment_as_default(monkeypatch) -> None:
    from nexa_dagster.definitions import build_defs

    for name in ("tiny", "small"):
        monkeypatch.setenv("NEXA_SCALE", name)
        defs = build_defs()
        for job in ("daily_data_job", "training_job", "pretraining_job"):
            assert _scale_in_schema(defs.resolve_job_def(job)) == {"name": name}, job
    # the training knobs a person changes per run sit beside it, empty (the preset's values) by default
    ops = defs.resolve_job_def("training_job").run_config_schema.config_type.fields["ops"].config_type
    knobs = ops.fields["moe_checkpoint"].config_type.fields["config"].config_type.fields
    assert {"init_from", "max_steps", "learning_rate"} <= set(knobs)


def _materialize(root: Path, *config: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        materialize_command("raw_documents", DAY, *config),
        cwd=REPO_ROOT,
        env=sandbox_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_launched_with_another_scale_uses_it_and_records_it(tmp_path: Path, monkeypatch) -> None:
    root = make_sandbox(tmp_path)
    day = root / "landing" / DAY  # ten documents more than the tiny preset's cap of a day
    day.mkdir(parents=True)
    lines = (
        json.dumps({"title": f"note {i}", "text": f"Note {i}: " + "words " * 20})
        for i in range(TINY_CAP + 10)
    )
    (day / "notes.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.delenv("NEXA_SCALE", raising=False)
    default = _materialize(root)  # what a schedule launches: no config, the environment's preset (tiny)
    assert default.returncode == 0, default.stderr[-3000:]
    run_config = tmp_path / "full.yaml"
    run_config.write_text(yaml.safe_dump({"resources": {"scale_preset": {"config": {"name": "full"}}}}))
    launched = _materialize(
        root, "-c", str(run_config)
    )  # as `dagster job launch --config` and the Launchpad pass it
    assert launched.returncode == 0, launched.stderr[-3000:]

    instance = dg.DagsterInstance.from_config(str(root / "home"))
    try:
        events = instance.fetch_materializations(dg.AssetKey("raw_documents"), limit=10).records
        by_scale = {e.asset_materialization.metadata["scale"].value: e for e in events}
        assert set(by_scale) == {"tiny", "full"}
        rows = {
            scale: e.asset_materialization.metadata["dagster/row_count"].value
            for scale, e in by_scale.items()
        }
        assert rows == {"tiny": TINY_CAP, "full": TINY_CAP + 10}, rows  # tiny caps a day, full does not
        recorded = instance.get_run_by_id(by_scale["full"].run_id).run_config
        assert recorded["resources"]["scale_preset"]["config"]["name"] == "full", json.dumps(recorded)
    finally:
        instance.dispose()


def test_a_scale_with_no_preset_file_fails_at_launch_and_at_load_naming_the_file(
    tmp_path: Path, monkeypatch
) -> None:
    from nexa_dagster.core.common.config import ConfigError, config_dir
    from nexa_dagster.definitions import build_defs

    root = make_sandbox(tmp_path, days=[DAY])
    for key, value in sandbox_env(root).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("NEXA_SCALE", raising=False)
    job = build_defs().resolve_job_def("daily_data_job")
    instance = dg.DagsterInstance.from_config(str(root / "home"))
    try:
        result = job.execute_in_process(
            instance=instance,
            partition_key=DAY,
            raise_on_error=False,
            asset_selection=[dg.AssetKey("raw_documents")],
            run_config={"resources": {"scale_preset": {"config": {"name": "huge"}}}},
        )
        assert not result.success
        failures = [str(e.event_specific_data.error) for e in result.all_events if e.is_failure]
        assert failures and all(f"no file {config_dir() / 'scales' / 'huge.yaml'}" in f for f in failures), (
            failures
        )
        presets = ", ".join(sorted(p.stem for p in (config_dir() / "scales").glob("*.yaml")))
        assert "tiny" in presets and f"presets: {presets}" in failures[0]
        assert not instance.fetch_materializations(dg.AssetKey("raw_documents"), limit=1).records
    finally:
        instance.dispose()

    monkeypatch.setenv("NEXA_SCALE", "huge")
    with pytest.raises(ConfigError, match=r"NEXA_SCALE: scale preset 'huge': no file .*scales/huge\.yaml"):
        build_defs()
