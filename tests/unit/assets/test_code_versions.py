"""Code versions follow the code (assets/versions.py): an edit of a module an asset's computation reaches, of a
configuration section it reads, or of a library that decides its bytes gives it a new code version, and nothing
else does. Every edit is made to a copy of the package and of configs/ (never to the tree the other tests import),
and the versions are computed from that copy as the code location computes them at load; the first test checks
that what Dagster's public API (``Definitions.resolve_all_asset_specs``) shows is that computation.

Staleness itself is Dagster's: an asset whose spec's code version differs from the one its latest materialization
recorded (the ``dagster/code_version`` tag) is shown "has a new code version"; the last test materializes the specs
on a real instance and reads that tag back."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import dagster as dg
import pytest

from nexa_dagster.assets import versions
from nexa_dagster.core.common.config import config_dir
from nexa_dagster.core.common.python_source import parse_python

CODE_VERSION_TAG = "dagster/code_version"  # what a materialization records, and staleness compares


@pytest.fixture(scope="module")
def loaded() -> tuple[dg.Definitions, list[dg.AssetsDefinition], dict]:
    from nexa_dagster.definitions import ASSET_MODULES, build_defs, config_resources

    assets = [a for a in dg.load_assets_from_modules(ASSET_MODULES) if isinstance(a, dg.AssetsDefinition)]
    return build_defs(), assets, config_resources()


@pytest.fixture(scope="module")
def baseline(loaded) -> dict[str, str]:
    _, assets, resources = loaded
    return versions.code_versions(assets, resources)


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A copy of the package's sources (the folder holding nexa_dagster/), to edit."""
    shutil.copytree(
        versions.SOURCE_ROOT / "nexa_dagster",
        tmp_path / "src" / "nexa_dagster",
        ignore=shutil.ignore_patterns("__pycache__", "weights", "*.so"),
    )
    return tmp_path / "src"


def _changed(
    loaded, baseline: dict[str, str], source_root: Path = versions.SOURCE_ROOT, configs=None
) -> set[str]:
    _, assets, resources = loaded
    after = versions.code_versions(assets, resources, source_root, configs)
    assert after.keys() == baseline.keys()
    return {name for name in baseline if baseline[name] != after[name]}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found (the test's edit no longer applies)"
    path.write_text(text.replace(old, new, 1))


def test_what_dagster_shows_is_the_derived_code_version(loaded, baseline) -> None:
    defs, _, _ = loaded
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    assert specs["production_model"].code_version is None  # external: written by promotions, not computed
    shown = {name: s.code_version for name, s in specs.items() if name != "production_model"}
    assert shown == baseline
    assert len(set(baseline.values())) > 5  # assets reaching different code get different versions


def test_a_training_loop_edit_marks_the_trained_models_and_not_ingest(
    loaded, baseline, package: Path
) -> None:
    loop = package / "nexa_dagster" / "core" / "training" / "loop.py"
    _edit(loop, "floor: float = 0.1", "floor: float = 0.2")  # the learning-rate schedule's floor
    changed = _changed(loaded, baseline, package)
    trained = {"base_model", "moe_checkpoint", "preference_checkpoint"} | (
        {"rl_checkpoint"} & baseline.keys()
    )
    assert trained <= changed, trained - changed
    assert not changed & {
        "raw_documents",
        "teacher_samples",
        "filtered_samples",
        "eval_set",
        "model_deployment",
    }
    assert not changed & {"preference_pairs", "preference_dataset"}  # they never run the worker


def test_comments_and_docstrings_do_not_count(loaded, baseline, package: Path) -> None:
    loop = package / "nexa_dagster" / "core" / "training" / "loop.py"
    text = loop.read_text()
    text = re.sub(r'^("""[^"]*?)\n', r"\1 (a docstring edit)\n", text, count=1)  # the module docstring
    loop.write_text(text + "\n# a comment at the end\n\n")
    assert loop.read_text() != (versions.SOURCE_ROOT / "nexa_dagster/core/training/loop.py").read_text()
    assert _changed(loaded, baseline, package) == set()


def test_a_yaml_comment_does_not_count_and_a_value_does(loaded, baseline, tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    policy = configs / "promotion.yaml"
    policy.write_text(policy.read_text() + "\n# why a value is what it is\n")
    assert _changed(loaded, baseline, configs=configs) == set()
    policy.write_text(policy.read_text() + "registered_model: another-name\n")
    changed = _changed(loaded, baseline, configs=configs)
    assert "eval_report" in changed and "raw_documents" not in changed and "sft_dataset" not in changed


def test_the_dpo_learning_rate_marks_only_the_preference_assets(loaded, baseline, tmp_path: Path) -> None:
    """The preset counts field by field where the code reads a field: ``eval_report`` reads
    ``preference.rank_by`` and ``preference.reward`` (the reward that gates a reward-ranked DPO checkpoint), not
    the DPO learning rate, so the learning rate marks exactly the preference group, and nothing upstream of the
    pairs; the ranking field marks ``eval_report`` too."""
    defs, _, _ = loaded
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    preset = configs / "scales" / "tiny.yaml"
    text = preset.read_text()
    section = text.index("\npreference:")
    dpo_rate = text.index("learning_rate:", section)
    preset.write_text(text[:dpo_rate] + "learning_rate: 2.0e-3  #" + text[dpo_rate + len("learning_rate:") :])
    preference = {
        s.key.to_user_string()
        for s in defs.resolve_all_asset_specs()
        if s.group_name == "preference" and s.code_version is not None
    }
    assert preference == {"preference_pairs", "preference_dataset", "preference_checkpoint"}
    assert _changed(loaded, baseline, configs=configs) == preference

    preset.write_text(text.replace("\n  rank_by: reward", "\n  rank_by: judge", 1))
    assert preset.read_text() != text, "tiny.yaml's preference.rank_by is no longer reward"
    assert "eval_report" in _changed(loaded, baseline, configs=configs)


def test_a_field_read_counts_the_field_and_a_section_used_whole_counts_whole() -> None:
    """What the preset's hashing keys on, read from code: a field read is that field; a test against None is the
    section's presence; a section passed on, or a method or property of it (which may read any field), is the
    whole section."""
    import ast

    code = (
        "a = scale.preference.rank_by\n"
        "b = scale.rl is None\n"
        "c = f(scale.training)\n"
        "d = scale_preset.load().pretraining.settings(x)\n"
    )
    reads = versions._scale_reads(list(ast.walk(parse_python(code, "<test>"))))
    assert reads == {"preference.rank_by", "rl?", "training", "pretraining.settings"}
    assert [versions._as_read(r) for r in sorted(reads)] == [
        "preference.rank_by",
        "pretraining",
        "rl?",
        "training",
    ]


def test_a_promotion_gate_edit_marks_eval_report(loaded, baseline, package: Path) -> None:
    promotion = package / "nexa_dagster" / "core" / "evaluation" / "promotion.py"
    _edit(promotion, "measured.n >= minimum:", "measured.n > minimum:")  # the gate's evidence rule
    changed = _changed(loaded, baseline, package)
    assert "eval_report" in changed, changed
    assert not changed & {"raw_documents", "sft_dataset", "moe_checkpoint", "preference_pairs"}, changed


@pytest.mark.parametrize("library", ["torch", "transformers"])
def test_a_training_library_upgrade_marks_the_trained_models(
    loaded, baseline, monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    """torch and transformers decide a trained checkpoint's bytes (kernels, the saved format): an upgrade marks
    the trained models, never the ingest, which never imports them. (The judge's tables are marked too: the judge
    samples through the LLM backends, the local one a transformers model.)"""
    real = versions.library_version
    monkeypatch.setattr(versions, "library_version", lambda name: "9.9.9" if name == library else real(name))
    changed = _changed(loaded, baseline)
    assert {"moe_checkpoint", "base_model", "preference_checkpoint", "rl_checkpoint"} <= changed, changed
    assert "filtered_samples" in changed and "raw_documents" not in changed, changed


def test_a_library_upgrade_marks_what_it_decides(loaded, baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    real = versions.library_version
    monkeypatch.setattr(
        versions, "library_version", lambda name: "9.9.9" if name == "tokenizers" else real(name)
    )
    changed = _changed(loaded, baseline)
    assert "sft_dataset" in changed and "raw_documents" not in changed, changed


def test_a_new_code_version_is_what_a_materialization_recorded_no_more(loaded, package: Path) -> None:
    """Dagster records the spec's code version with each materialization; an edited loop gives moe_checkpoint a
    version other than the recorded one (what the UI shows as "has a new code version")."""
    defs, assets, resources = loaded
    spec = next(s for s in defs.resolve_all_asset_specs() if s.key == dg.AssetKey("moe_checkpoint"))

    @dg.multi_asset(specs=[spec.replace_attributes(deps=[])], name="stand_in_moe_checkpoint")
    def stand_in() -> dg.MaterializeResult:
        return dg.MaterializeResult(asset_key=spec.key)

    with dg.instance_for_test() as instance:
        assert dg.materialize([stand_in], instance=instance).success
        event = instance.get_latest_materialization_event(spec.key)
        recorded = event.asset_materialization.tags[CODE_VERSION_TAG]
    assert recorded == spec.code_version
    loop = package / "nexa_dagster" / "core" / "training" / "loop.py"
    _edit(loop, "floor: float = 0.1", "floor: float = 0.2")
    assert versions.code_versions(assets, resources, package)["moe_checkpoint"] != recorded


def test_a_sampling_edit_in_the_local_backend_marks_the_teacher_samples(
    loaded, baseline, package: Path
) -> None:
    """``teacher_samples`` is given the abstract LLM resource; the backend that samples is a subclass of it, so
    an edit of how the local backend samples (here: top-k) changes what the teacher writes and marks it. Assets
    that never ask an LLM (ingest, the eval sets' freezing, the pairs' split) keep their versions."""
    local = package / "nexa_dagster" / "core" / "llm" / "local.py"
    _edit(local, "top_p=params.top_p, top_k=0", "top_p=params.top_p, top_k=50")
    changed = _changed(loaded, baseline, package)
    # the teacher, the judge and the policy sampling pairs all sample through the backend
    assert {"teacher_samples", "filtered_samples", "preference_pairs"} <= changed, changed
    assert not changed & {"raw_documents", "eval_set", "rl_eval_set", "preference_dataset"}, changed


def test_a_local_cluster_edit_marks_the_rl_checkpoint(loaded, baseline, package: Path) -> None:
    """The RL policy is trained by the backend the ``gpu_cluster`` resource is (a subclass of the abstract
    ``GPUClusterResource`` the asset names): an edit of how the local backend launches a worker marks it, and not
    the assets that are never given a cluster."""
    local = package / "nexa_dagster" / "resources" / "gpu_cluster" / "local.py"
    _edit(local, 'settings.WORKER_ECHO.name: "0"', 'settings.WORKER_ECHO.name: "1"')
    changed = _changed(loaded, baseline, package)
    assert {"moe_checkpoint"} | ({"rl_checkpoint"} & baseline.keys()) <= changed, changed
    assert not changed & {
        "raw_documents",
        "teacher_samples",
        "filtered_samples",
        "preference_pairs",
        "eval_set",
    }


def test_a_tuple_assigned_constant_counts(loaded, baseline, package: Path) -> None:
    """``CHOSEN, REJECTED = 0, 1`` decides which side of a pair a packed document is: swapping them changes the
    DPO checkpoint, and nothing that never launches the training worker that packs pairs (the worker is one
    module for every kind of training, so the other trained models count it too)."""
    pairs = package / "nexa_dagster" / "core" / "training" / "preference_data.py"
    _edit(pairs, "CHOSEN, REJECTED = 0, 1", "CHOSEN, REJECTED = 1, 0")
    changed = _changed(loaded, baseline, package)
    assert "preference_checkpoint" in changed, changed
    assert not changed & {"raw_documents", "teacher_samples", "preference_pairs", "preference_dataset"}, (
        changed
    )


def test_a_relative_import_inside_a_package_init_function_is_followed(loaded, package: Path) -> None:
    """``from .loop import ...`` inside a function of ``core/training/__init__.py`` is ``core.training.loop`` (the
    package the ``__init__`` is), not ``core.loop``: an asset reaching that function follows the loop's edits."""
    training = package / "nexa_dagster" / "core" / "training" / "__init__.py"
    training.write_text(
        training.read_text()
        + "\n\ndef schedule():\n    from .loop import warmup_cosine\n\n    return warmup_cosine\n"
    )
    ingest = package / "nexa_dagster" / "assets" / "ingest.py"
    anchor = "    scale = scale_preset.load()\n    frames, quarantined"
    _edit(ingest, anchor, "    from nexa_dagster.core.training import schedule\n\n    schedule()\n" + anchor)
    _, assets, resources = loaded
    before = versions.code_versions(assets, resources, package)
    _edit(
        package / "nexa_dagster" / "core" / "training" / "loop.py", "floor: float = 0.1", "floor: float = 0.2"
    )
    after = versions.code_versions(assets, resources, package)
    assert after["raw_documents"] != before["raw_documents"]
    assert after["teacher_samples"] == before["teacher_samples"]  # still reaches neither function
