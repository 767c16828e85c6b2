"""Code versions come from what decides an asset's output (assets/versions.py), and Dagster's own staleness API
sees a change of either: a packing format version raised in the core marks ``sft_dataset`` stale ("has a new code
version") and nothing upstream; once it is materialized again under the new version, what it feeds goes stale in
turn ("has a new dependency data version") down to the served model.

Materializations are real Dagster runs on a real (ephemeral) instance, of each asset's spec as the code location
defines it (key, deps, partitions, code version); only their bodies are stand-ins (the stage itself is not what
staleness reads), so the test takes seconds where the lifecycle takes minutes."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from nexa_dagster.assets import versions
from nexa_dagster.core.packaging import sft_dataset as sft_core

CHAIN = ["filtered_samples", "eval_set", "sft_dataset", "base_model", "moe_checkpoint"]
PER_CHECKPOINT = ["eval_report", "model_deployment"]
DAY, CHECKPOINT = "2026-11-20", "ckpt-1"


def _defs() -> dg.Definitions:
    from nexa_dagster.definitions import build_defs

    return build_defs()


def _stand_in(spec: dg.AssetSpec) -> dg.AssetsDefinition:
    @dg.multi_asset(specs=[spec], name=f"stand_in_{spec.key.path[-1]}")
    def _materialize() -> dg.MaterializeResult:
        return dg.MaterializeResult(asset_key=spec.key)

    return _materialize


def _stand_ins(defs: dg.Definitions) -> dict[str, dg.AssetsDefinition]:
    graph = defs.resolve_asset_graph()
    out = {}
    for name in [*CHAIN, *PER_CHECKPOINT]:
        key = dg.AssetKey(name)
        spec = next(s for s in graph.assets_def_for_key(key).specs if s.key == key)
        out[name] = _stand_in(spec)
    return out


def _materialize(
    defs: dg.Definitions, instance: dg.DagsterInstance, names: list[str], partition: str | None
) -> None:
    stand_ins = _stand_ins(defs)
    result = dg.materialize(
        [stand_ins[n] for n in names], instance=instance, partition_key=partition, raise_on_error=True
    )
    assert result.success


def _status(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[str, tuple[StaleStatus, list[str]]]:
    resolver = CachingStaleStatusResolver(
        instance, defs.resolve_asset_graph(), LoadingContextForTest(instance)
    )  # what the UI's stale markers read (WorkspaceRequestContext.stale_status_loader)
    out = {}
    for name in [*CHAIN, *PER_CHECKPOINT]:
        key = dg.AssetKey(name)
        partition = {"filtered_samples": DAY, **dict.fromkeys(PER_CHECKPOINT, CHECKPOINT)}.get(name)
        causes = [c.reason for c in resolver.get_stale_causes(key, partition)]
        out[name] = (resolver.get_status(key, partition), causes)
    return out


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions("checkpoints", [CHECKPOINT])
        yield inst


def test_every_asset_has_a_code_version_from_its_sources() -> None:
    graph = _defs().resolve_asset_graph()
    materialized_here = [k for k in graph.get_all_asset_keys() if graph.get(k).is_materializable]
    assert len(materialized_here) == len(versions.SOURCES)
    for key in materialized_here:  # an external asset (production_model: the pointer serving writes) has none
        assert graph.get(key).code_version == versions.code_version(key.to_user_string()), key


def test_a_config_file_edit_changes_the_code_version_of_the_assets_it_decides(tmp_path: Path) -> None:
    import shutil

    from nexa_dagster.core.common.config import config_dir

    shutil.copytree(config_dir(), tmp_path / "configs")
    before = {a: versions.code_version(a, tmp_path / "configs") for a in versions.SOURCES}
    promotion = tmp_path / "configs" / "promotion.yaml"
    promotion.write_text(promotion.read_text() + "\n# an edit\n")
    after = {a: versions.code_version(a, tmp_path / "configs") for a in versions.SOURCES}
    changed = {a for a in before if before[a] != after[a]}
    assert changed == {a for a, s in versions.SOURCES.items() if "promotion.yaml" in s.configs}
    assert changed >= {"eval_report", "model_deployment"} and "sft_dataset" not in changed


def test_a_packing_format_change_marks_sft_dataset_and_what_it_feeds_stale(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    defs = _defs()
    _materialize(defs, instance, ["filtered_samples"], DAY)
    _materialize(defs, instance, ["eval_set", "sft_dataset", "base_model", "moe_checkpoint"], None)
    _materialize(defs, instance, PER_CHECKPOINT, CHECKPOINT)
    assert {n: s for n, (s, _) in _status(defs, instance).items()} == dict.fromkeys(
        [*CHAIN, *PER_CHECKPOINT], StaleStatus.FRESH
    )

    monkeypatch.setattr(sft_core, "FORMAT", sft_core.FORMAT + "-next")  # a new packed layout in the core
    changed = _defs()
    status = _status(changed, instance)
    assert status["sft_dataset"] == (StaleStatus.STALE, ["has a new code version"])
    for upstream in ("filtered_samples", "eval_set", "base_model"):
        assert status[upstream][0] == StaleStatus.FRESH, (upstream, status[upstream])

    # materialized again under the new version, each asset's new data version makes its dependents stale
    for names, partition, downstream in [
        (["sft_dataset"], None, "moe_checkpoint"),
        (["moe_checkpoint"], None, "eval_report"),
        (["eval_report"], CHECKPOINT, "model_deployment"),
    ]:
        _materialize(changed, instance, names, partition)
        status = _status(changed, instance)
        assert status[names[0]][0] == StaleStatus.FRESH, status[names[0]]
        assert status[downstream] == (StaleStatus.STALE, ["has a new dependency data version"]), status[
            downstream
        ]


def test_an_asset_without_sources_fails_the_load() -> None:
    @dg.asset
    def unlisted() -> None: ...

    with pytest.raises(KeyError, match="asset unlisted has no entry"):
        versions.with_code_versions([unlisted])
