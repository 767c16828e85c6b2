"""Bad input fails at the stage boundary with a message naming the file/row/URL; nothing materialized is lost."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from nexa_dagster.assets.common import MODEL_CALL_RETRY
from nexa_dagster.assets.distill import teacher_samples
from nexa_dagster.assets.ingest import raw_documents
from nexa_dagster.definitions import config_resources
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.llm import OpenAILLM
from nexa_dagster.resources.storage import StorageResource

DAY = "2026-11-20"


def _resources(tmp_path: Path) -> dict[str, object]:
    return {
        **config_resources(),
        "io_manager": NexaIOManager(data_root=str(tmp_path / "data")),
        "storage": StorageResource(data_root=str(tmp_path / "data"), landing_root=str(tmp_path / "landing")),
        **config_resources(),
    }


def _land(tmp_path: Path, lines: list[str]) -> None:
    day = tmp_path / "landing" / DAY
    day.mkdir(parents=True, exist_ok=True)
    (day / "docs.jsonl").write_text("\n".join(lines) + "\n")


def test_a_bad_rerun_leaves_the_materialized_partition_untouched(tmp_path: Path) -> None:
    instance = dg.DagsterInstance.ephemeral()
    _land(tmp_path, [json.dumps({"title": "t", "text": f"document number {i}"}) for i in range(3)])
    assert dg.materialize(
        [raw_documents], partition_key=DAY, resources=_resources(tmp_path), instance=instance
    ).success
    stored = tmp_path / "data" / "assets" / "raw_documents" / f"{DAY}.parquet"
    before = stored.read_bytes()

    _land(tmp_path, [json.dumps({"text": "fine"}), "{not json"])
    result = dg.materialize(
        [raw_documents],
        partition_key=DAY,
        resources=_resources(tmp_path),
        instance=instance,
        raise_on_error=False,
    )
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert f"{DAY}/docs.jsonl:2: malformed JSON" in failure
    assert stored.read_bytes() == before
    assert len(pd.read_parquet(stored)) == 3
    assert not list(stored.parent.glob(".*tmp"))


def test_wrong_column_type_fails_the_typed_boundary(tmp_path: Path) -> None:
    """A frame that breaks the pandera schema fails the step with the column named."""

    @dg.asset(name="raw_documents_bad", dagster_type=raw_documents.op.outs["result"].dagster_type)
    def bad() -> pd.DataFrame:
        return pd.DataFrame(
            {
                "doc_id": ["x" * 16],
                "day": ["not-a-day"],
                "source": ["s"],
                "title": ["t"],
                "text": ["body"],
                "n_chars": [4],
            }
        )

    result = dg.materialize([bad], resources=_resources(tmp_path), raise_on_error=False)
    assert not result.success
    message = str(result.get_step_failure_events()[0].step_failure_data.error.message)
    assert "day" in message


@pytest.mark.waits  # 14 s of the retry policy's delays (below)
def test_unreachable_teacher_endpoint_names_the_url(tmp_path: Path) -> None:
    _land(tmp_path, [json.dumps({"title": "t", "text": f"document number {i}"}) for i in range(2)])
    resources = {
        **_resources(tmp_path),
        "teacher_llm": OpenAILLM(
            model="m",
            base_url="http://127.0.0.1:9/v1",
            api_key="sk-secret-do-not-log",
            max_retries=0,
            timeout_s=2,
        ),
    }
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([raw_documents], partition_key=DAY, resources=resources, instance=instance).success
    result = dg.materialize(
        [raw_documents.to_source_asset(), teacher_samples],
        partition_key=DAY,
        resources=resources,
        instance=instance,
        raise_on_error=False,
        selection=[teacher_samples],
    )
    assert not result.success
    events = [e for e in result.all_events if e.is_step_failure]
    text = (
        events[0].step_failure_data.user_failure_data.description
        if events[0].step_failure_data.user_failure_data
        else events[0].step_failure_data.error.message
    )
    assert "127.0.0.1:9" in text
    assert "sk-secret-do-not-log" not in text
    # an endpoint down may be one restarting: the asset's retry policy (MODEL_CALL_RETRY) asks again three times,
    # 2, 4 and 8 s apart (most of this test's time), before the run fails
    retries = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    assert len(retries) == MODEL_CALL_RETRY.max_retries == 3, len(retries)


@pytest.mark.parametrize("bad_day", ["2026-11-19"])
def test_empty_partition_fails_with_the_folder_named(tmp_path: Path, bad_day: str) -> None:
    result = dg.materialize(
        [raw_documents], partition_key=bad_day, resources=_resources(tmp_path), raise_on_error=False
    )
    assert not result.success
    description = result.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert f"partition {bad_day}: no documents landed" in description


def test_quarantine_lets_the_day_through_and_lists_its_bad_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from nexa_dagster.core.common.config import config_dir

    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    pipeline = configs / "pipeline.yaml"
    pipeline.write_text(pipeline.read_text().replace("on_error: raise", "on_error: quarantine"))
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
    instance = dg.DagsterInstance.ephemeral()
    _land(
        tmp_path,
        [
            "\ufeff" + json.dumps({"text": "first, after a byte-order mark"}),
            "{not json",
            json.dumps({"text": "fine"}),
            json.dumps({"text": ["a", "list"]}),
        ],
    )
    result = dg.materialize(
        [raw_documents], partition_key=DAY, resources=_resources(tmp_path), instance=instance
    )
    metadata = result.asset_materializations_for_node("raw_documents")[0].metadata
    assert metadata["dagster/row_count"].value == 2 and metadata["quarantined_rows"].value == 2
    quarantine = tmp_path / "data" / "quarantine" / "raw_documents" / f"{DAY}.jsonl"
    assert metadata["quarantine_paths"].value == [str(quarantine)]
    bad = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [(b["where"], b["reason"].split(" (")[0], b["raw"]) for b in bad] == [
        (f"{DAY}/docs.jsonl:2", "malformed JSON", "{not json"),
        (f"{DAY}/docs.jsonl:4", "field 'text' must be a string, got list", '{"text": ["a", "list"]}'),
    ]

    _land(tmp_path, [json.dumps({"text": "all fixed"})])  # the day landed again, clean: no stale quarantine
    result = dg.materialize(
        [raw_documents], partition_key=DAY, resources=_resources(tmp_path), instance=instance
    )
    assert result.asset_materializations_for_node("raw_documents")[0].metadata["quarantined_rows"].value == 0
    assert not quarantine.exists()
