"""The code location loads the way the UI and `dagster definitions validate` load it."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import pytest

from nexa_dagster.core.common.config import REPO_ROOT

STAGE_KEYS = {
    "raw_documents",
    "teacher_samples",
    "filtered_samples",
    "rejected_samples",
    "sft_dataset",
    "eval_set",
    "moe_checkpoint",
    "eval_report",
    "model_deployment",
}


def test_dagster_definitions_validate_passes(tmp_path) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "All code locations passed validation" in proc.stderr + proc.stdout


def test_lineage_graph_has_every_stage_in_order() -> None:
    from nexa_dagster.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys >= STAGE_KEYS
    upstream = {k: {p.to_user_string() for p in graph.get(dg.AssetKey(k)).parent_keys} for k in STAGE_KEYS}
    assert upstream["teacher_samples"] == {"raw_documents"}
    assert upstream["filtered_samples"] == {"teacher_samples"}
    # the eval set and the held-out RL prompts are frozen before packaging, which leaves out every row that quotes
    # them (decontamination); raw_documents: the checkable tasks the SFT blend packs beside the judged samples
    assert upstream["sft_dataset"] == {"filtered_samples", "raw_documents", "eval_set", "rl_eval_set"}
    assert upstream["moe_checkpoint"] == {"sft_dataset", "base_model"}  # corpus -> base -> SFT lineage
    assert {p.to_user_string() for p in graph.get(dg.AssetKey("base_model")).parent_keys} == {
        "pretrain_corpus",
        "eval_set",  # no base model trains on a corpus document that quotes the eval set
        "rl_eval_set",  # nor on one that holds a held-out RL prompt's passage (the RL gate's evidence)
    }
    assert {"moe_checkpoint", "eval_set"} <= upstream["eval_report"]
    # the eval set freezes held-out samples and held-out corpus documents; base models are scored on the latter
    assert upstream["eval_set"] == {"filtered_samples", "pretrain_corpus"}
    assert {p.to_user_string() for p in graph.get(dg.AssetKey("base_model_eval")).parent_keys} == {
        "base_model",
        "eval_set",
    }
    assert upstream["model_deployment"] == {"eval_report"}
    # pretrain -> SFT -> preference: pairs from the judged samples, DPO from the production SFT model
    pairs, dataset, dpo = (
        {p.to_user_string() for p in graph.get(dg.AssetKey(k)).parent_keys}
        for k in ("preference_pairs", "preference_dataset", "preference_checkpoint")
    )
    # the stage reads the model in production (the pointer model_deployment writes), not a fixed SFT checkpoint
    # (preference.rank_by: reward asks about the day's documents: raw_documents)
    assert pairs == {"filtered_samples", "raw_documents", "production_model"}
    assert dataset == {"preference_pairs", "eval_set", "rl_eval_set", "production_model"}
    assert (
        dpo == {"preference_dataset", "production_model"}
        and "preference_checkpoint" in upstream["eval_report"]
    )
    # SFT -> preference -> RL: checkable prompts from the documents (the eval set frozen first), a frozen held-out
    # set drawn from them, GRPO from the production model; evaluated and gated like every checkpoint
    prompts, held, rl = (
        {p.to_user_string() for p in graph.get(dg.AssetKey(k)).parent_keys}
        for k in ("rl_prompts", "rl_eval_set", "rl_checkpoint")
    )
    assert prompts == {"filtered_samples", "raw_documents", "eval_set"} and held == {"rl_prompts"}
    # sft_dataset: the rows PPO-ptx mixes into every GRPO step (rl.ptx_coef)
    assert rl == {"rl_prompts", "rl_eval_set", "production_model", "sft_dataset"}
    assert {"rl_checkpoint", "rl_eval_set"} <= upstream["eval_report"]
    assert graph.get(dg.AssetKey("rl_checkpoint")).assets_def.op.pool == "gpu"


def test_model_calling_stages_retry_and_training_uses_the_gpu_pool() -> None:
    from nexa_dagster.definitions import defs

    graph = defs.resolve_asset_graph()
    for key in (
        "teacher_samples",
        "filtered_samples",
        "moe_checkpoint",
        "base_model",
        "eval_report",
        "model_deployment",
    ):
        node = graph.get(dg.AssetKey(key))
        policy = node.assets_def.op.retry_policy
        assert policy is not None and policy.max_retries >= 1, key
    assert graph.get(dg.AssetKey("moe_checkpoint")).assets_def.op.pool == "gpu"
    assert graph.get(dg.AssetKey("base_model")).assets_def.op.pool == "gpu"


def test_steps_are_forked_and_retried_unless_a_run_turns_retries_off() -> None:
    """Every job's steps start from a forkserver and retry by their policies; a run can turn the retries off
    (`execution.config.retries: disabled`, as the kill tests do) and nothing else: the start method is fixed (that
    no step imports the code location again: tests/integration/test_step_processes.py)."""
    from nexa_dagster.definitions import defs
    from nexa_dagster.step_executor import STEP_PRELOAD, PlanPreloadingExecutor

    assert STEP_PRELOAD[0] == "nexa_dagster.definitions"
    job = defs.resolve_job_def("training_job")
    assert job.executor_def.name == "multiprocess_forkserver"
    assert dg.validate_run_config(job, {})["execution"]["multiprocess_forkserver"] == {
        "retries": {"enabled": {}}
    }
    off = {"execution": {"config": {"retries": {"disabled": {}}}}}
    assert (
        dg.validate_run_config(job, off)["execution"]["multiprocess_forkserver"] == off["execution"]["config"]
    )
    with pytest.raises(dg.DagsterInvalidConfigError):
        dg.validate_run_config(job, {"execution": {"config": {"start_method": {"spawn": {}}}}})
    executor = job.executor_def.executor_creation_fn(  # type: ignore[misc]
        dg.InitExecutorContext(
            job=dg.reconstructable(_training_job),
            executor_def=job.executor_def,
            executor_config={"retries": {"disabled": {}}},
            instance=dg.DagsterInstance.ephemeral(),
        )
    )
    assert isinstance(executor, PlanPreloadingExecutor) and not executor.retries.enabled


def _training_job() -> dg.JobDefinition:
    from nexa_dagster.definitions import defs

    return defs.resolve_job_def("training_job")


def test_torch_is_preloaded_for_a_run_of_two_steps_that_import_it_and_not_for_one() -> None:
    """The forkserver imports torch and transformers for a plan with two or more steps tagged IMPORTS_MODELS
    (training_job: the packing, the training launch and the checkpoint's check), not for one with fewer: the
    leaderboard, a training alone. Which steps import them was recorded (docs/measurements.md, "Step processes");
    that the server, not the steps, then imports torch: tests/integration/test_step_processes.py."""
    from dagster._core.execution.api import create_execution_plan

    from nexa_dagster.definitions import defs
    from nexa_dagster.step_executor import MODEL_PRELOAD, STEP_PRELOAD, preload_for

    def preload(job_name: str, steps: list[str] | None = None) -> list[str]:
        job = defs.resolve_job_def(job_name)
        plan = create_execution_plan(job, step_keys_to_execute=steps)
        return preload_for(plan)

    with_models, without = [*STEP_PRELOAD, *MODEL_PRELOAD], list(STEP_PRELOAD)
    assert preload("training_job") == with_models
    assert preload("pretraining_job") == with_models
    assert preload("leaderboard_job") == without
    assert preload("training_job", ["moe_checkpoint"]) == without  # one such step: it imports them itself
    launch_and_check = ["moe_checkpoint", "moe_checkpoint_checkpoint_loads_with_transformers"]
    assert preload("training_job", launch_and_check) == with_models


# -- configuration files are validated when the code location loads (issue 17.8) ---------------------------------
CONFIG_TYPOS = {  # file: (text in the shipped file, the typo, what the error must say)
    "gpu_cluster accelerator": (
        "pipeline.yaml",
        "  accelerator: cpu",
        "  acelerator: cuda",
        "pipeline.yaml: gpu_cluster.acelerator: unknown key",
    ),
    "gpu_cluster backend": (
        "pipeline.yaml",
        "  backend: local ",
        "  backend: slrum ",
        "pipeline.yaml: gpu_cluster.backend: unknown backend 'slrum'; one of: local, slurm, kubernetes",
    ),
    "gpu_cluster field of another backend": (
        "pipeline.yaml",
        "  # slurm_partition: gpu",
        "  slurm_partition: gpu",
        "pipeline.yaml: gpu_cluster.slurm_partition: a field of the slurm backend, but the cluster is backend "
        "'local'",
    ),
    "pipeline top-level key": (
        "pipeline.yaml",
        "data_root:",
        "data_rot:",
        "pipeline.yaml: data_rot: unknown key",
    ),
    "a key that moved": (
        "pipeline.yaml",
        "data_root: data\n",
        'data_root: data\npartitions_start_date: "2026-11-01"\n',
        "pipeline.yaml: (the whole file): Value error, partitions_start_date moved to the environment "
        "variable NEXA_PARTITIONS_START",
    ),
    "eval_set resource": (
        "pipeline.yaml",
        "  fraction: 0.4",
        "  fractoin: 0.4",
        "pipeline.yaml: eval_set.fractoin: unknown key",
    ),
    "ingest resource": (
        "pipeline.yaml",
        "  on_error: raise",
        "  on_error: skip",
        "pipeline.yaml: ingest.on_error: Input should be",
    ),
    "pipeline missing key": (
        "pipeline.yaml",
        "  teacher: tiny-teacher\n",
        "",
        "pipeline.yaml: models.teacher: missing",
    ),
    "scale preset key": (
        "scales/full.yaml",
        "  max_steps:",
        "  max_step:",
        "scales/full.yaml: training.max_step: unknown key",
    ),
    "scale preset reference": (
        "scales/small.yaml",
        "model_preset: nexa-moe-mini",
        "model_preset: nexa-moe-mnii",
        "scales/small.yaml: model_preset: 'nexa-moe-mnii' names no file",
    ),
    "model preset": (
        "models/nexa-ultramax.yaml",
        "num_local_experts:",
        "num_local_expert:",
        "models/nexa-ultramax.yaml: num_local_expert: unknown key",
    ),
    "promotion": ("promotion.yaml", "margin:", "margn:", "promotion.yaml: margn: unknown key"),
    "filters": (
        "filters.production.yaml",
        "  min_score:",
        "  min_scor:",
        "filters.production.yaml: judge.min_scor: unknown key",
    ),
    "packaging": (
        "packaging.yaml",
        "on_error: raise",
        "on_error: skip",
        "packaging.yaml: on_error: Input should be",
    ),
    "blend": ("blends/rl.yaml", "sources:", "source:", "blends/rl.yaml: source: unknown key"),
}


def _configs_with(tmp_path, relative: str, old: str, new: str):
    import shutil

    from nexa_dagster.core.common.config import config_dir

    configs = shutil.copytree(config_dir(), tmp_path / "configs")
    text = (configs / relative).read_text()
    assert old in text, f"{relative} no longer has {old!r}: update the test"
    (configs / relative).write_text(text.replace(old, new, 1))
    return configs


@pytest.mark.parametrize("case", sorted(CONFIG_TYPOS))
def test_a_config_typo_fails_the_load_naming_the_file_and_key(case: str, tmp_path, monkeypatch) -> None:
    from nexa_dagster.core.common.config import ConfigError
    from nexa_dagster.definitions import build_defs

    relative, old, new, expected = CONFIG_TYPOS[case]
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(_configs_with(tmp_path, relative, old, new)))
    with pytest.raises(ConfigError) as raised:
        build_defs()
    assert f"{tmp_path}/configs/{expected}" in str(raised.value)


def test_the_backend_picks_a_typed_cluster_class_and_the_environment_overrides_it(
    tmp_path, monkeypatch
) -> None:
    """``gpu_cluster.backend`` builds that backend's class with its own fields; ``NEXA_CLUSTER_BACKEND`` overrides
    the file's backend, and then the file's fields of another backend fail the load, saying where the backend
    came from."""
    from nexa_dagster.core.common.config import ConfigError
    from nexa_dagster.definitions import build_defs, build_resources
    from nexa_dagster.resources.gpu_cluster import LocalGPUCluster, SlurmGPUCluster

    monkeypatch.delenv("NEXA_ACCELERATOR", raising=False)
    monkeypatch.delenv("NEXA_CLUSTER_BACKEND", raising=False)
    assert type(build_resources()["gpu_cluster"]) is LocalGPUCluster
    configs = _configs_with(
        tmp_path,
        "pipeline.yaml",
        "  backend: local ",
        "  backend: slurm\n  nodes: 2\n  slurm_partition: gpu ",
    )
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
    cluster = build_resources()["gpu_cluster"]
    assert type(cluster) is SlurmGPUCluster and (cluster.nodes, cluster.slurm_partition) == (2, "gpu")
    assert cluster.world_size() == 2 * cluster.num_procs
    monkeypatch.setenv("NEXA_CLUSTER_BACKEND", "local")
    with pytest.raises(ConfigError) as raised:
        build_defs()
    assert (
        f"{configs}/pipeline.yaml: gpu_cluster.nodes: a field of the slurm backend, but the cluster is backend "
        "'local' (from NEXA_CLUSTER_BACKEND)"
    ) in str(raised.value)
    monkeypatch.delenv(
        "NEXA_CONFIG_DIR"
    )  # the shipped file (backend: local) with the backend from the environment
    monkeypatch.setenv("NEXA_CLUSTER_BACKEND", "kubernetes")  # without its image: what pods would it start?
    with pytest.raises(
        ConfigError, match=r"gpu_cluster.k8s_image: missing \(required by backend 'kubernetes'"
    ):
        build_defs()


def test_make_run_forks_its_workers_from_a_warm_python_unless_the_file_says_not_to(
    tmp_path, monkeypatch
) -> None:
    """``build_defs(warm_workers=True)`` (``make run``) turns the local backend's ``warm_start`` on, and the
    resource Dagster builds for a step has it; a ``dagster`` run's code location (the default) and a file that
    says ``warm_start: false`` keep it off; another backend is left as it is."""
    from nexa_dagster.definitions import build_defs
    from nexa_dagster.resources.gpu_cluster import LocalGPUCluster, SlurmGPUCluster

    monkeypatch.delenv("NEXA_ACCELERATOR", raising=False)
    monkeypatch.delenv("NEXA_CLUSTER_BACKEND", raising=False)

    def cluster(defs: dg.Definitions) -> object:
        # what a step's context gets: the resource Dagster builds from the definition, not the object passed in
        with dg.build_resources({"gpu_cluster": defs.resources["gpu_cluster"]}) as built:
            return built.gpu_cluster

    assert cluster(build_defs(warm_workers=True)).warm_start is True
    assert cluster(build_defs()).warm_start is False
    monkeypatch.setenv(
        "NEXA_CONFIG_DIR",
        str(
            _configs_with(
                tmp_path / "off",
                "pipeline.yaml",
                "  backend: local ",
                "  backend: local\n  warm_start: false ",
            )
        ),
    )
    off = cluster(build_defs(warm_workers=True))
    assert type(off) is LocalGPUCluster and off.warm_start is False
    monkeypatch.delenv("NEXA_CONFIG_DIR")  # the next copy is of the shipped files
    monkeypatch.setenv(
        "NEXA_CONFIG_DIR",
        str(_configs_with(tmp_path / "slurm", "pipeline.yaml", "  backend: local ", "  backend: slurm ")),
    )
    assert type(cluster(build_defs(warm_workers=True))) is SlurmGPUCluster


def test_dagster_definitions_validate_fails_on_a_typo_in_an_unselected_scale(tmp_path) -> None:
    """`make validate` used to pass a typo in any scale but the one NEXA_SCALE selects (tiny)."""
    configs = _configs_with(tmp_path, "scales/full.yaml", "  learning_rate:", "  lerning_rate:")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "NEXA_CONFIG_DIR": str(configs), "NEXA_SCALE": "tiny"}
    proc = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert f"{configs}/scales/full.yaml: training.lerning_rate: unknown key" in proc.stderr + proc.stdout


def test_the_leaderboard_is_requested_after_new_evaluation_reports(tmp_path, monkeypatch) -> None:
    """The leaderboard's automation condition is evaluated by a sensor that runs by default, and it asks for a
    rebuild after a new checkpoint is evaluated, even when another checkpoint's evaluation is missing (failed)."""
    from support.sandbox import make_sandbox, sandbox_env

    for key, value in sandbox_env(make_sandbox(tmp_path)).items():
        monkeypatch.setenv(key, value)
    from nexa_dagster.definitions import build_defs

    defs = build_defs()
    sensors = [s for s in defs.sensors if isinstance(s, dg.AutomationConditionSensorDefinition)]
    assert len(sensors) == 1 and sensors[0].default_status == dg.DefaultSensorStatus.RUNNING
    assert dg.AssetKey("leaderboard") in sensors[0].asset_selection.resolve(defs.resolve_asset_graph())

    instance = dg.DagsterInstance.from_config(str(tmp_path / "home"))
    try:
        instance.add_dynamic_partitions("checkpoints", ["first", "failed", "second"])
        instance.report_runless_asset_event(dg.AssetMaterialization("eval_report", partition="first"))
        instance.report_runless_asset_event(dg.AssetMaterialization("leaderboard"))
        selection = dg.AssetSelection.assets("leaderboard")
        start = dg.evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=selection)
        assert start.total_requested == 0  # up to date
        instance.report_runless_asset_event(dg.AssetMaterialization("eval_report", partition="second"))
        after = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, asset_selection=selection, cursor=start.cursor
        )
        assert after.get_requested_partitions(dg.AssetKey("leaderboard")) == {None}
        once = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, asset_selection=selection, cursor=after.cursor
        )
        assert once.total_requested == 0  # requested once, not on every tick
    finally:
        instance.dispose()


def test_each_new_base_model_is_evaluated_once_when_an_eval_set_exists(tmp_path, monkeypatch) -> None:
    """The default automation sensor asks for ``base_model_eval`` of a base model that ``base_model`` added: not
    before an eval set is frozen (nothing to measure it on), once after, and never again for the same base model
    when another one arrives; and not while the eval set's blocking check has not passed."""
    from support.sandbox import make_sandbox, sandbox_env

    for key, value in sandbox_env(make_sandbox(tmp_path)).items():
        monkeypatch.setenv(key, value)
    from nexa_dagster.definitions import build_defs

    defs = build_defs()
    key = dg.AssetKey("base_model_eval")
    sensors = [s for s in defs.sensors if isinstance(s, dg.AutomationConditionSensorDefinition)]
    assert key in sensors[0].asset_selection.resolve(defs.resolve_asset_graph())
    instance = dg.DagsterInstance.from_config(str(tmp_path / "home"))
    selection = dg.AssetSelection.assets("base_model_eval")

    def tick(cursor):
        return dg.evaluate_automation_conditions(
            defs=defs, instance=instance, asset_selection=selection, cursor=cursor
        )

    try:
        start = tick(None)  # the sensor runs before any base model exists, as in a deployment
        instance.add_dynamic_partitions("base_models", ["base-a"])
        instance.report_runless_asset_event(dg.AssetMaterialization("base_model"))
        first = tick(start.cursor)
        assert first.total_requested == 0  # no eval set yet
        instance.report_runless_asset_event(dg.AssetMaterialization("eval_set"))
        second = tick(first.cursor)
        assert second.total_requested == 0  # its blocking check (the frozen files match) has not passed yet
        instance.report_runless_asset_event(
            dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey("eval_set"), check_name="eval_set_matches_its_manifest", passed=True
            )
        )
        second = tick(second.cursor)
        assert second.get_requested_partitions(key) == {"base-a"}
        instance.add_dynamic_partitions("base_models", ["base-b"])
        instance.report_runless_asset_event(dg.AssetMaterialization("base_model"))
        third = tick(second.cursor)
        assert third.get_requested_partitions(key) == {
            "base-b"
        }  # base-a (still missing: its run failed) not again
    finally:
        instance.dispose()


# -- one resource class per LLM backend, checked when the code location loads (issue 16) --------------------------
LLM_MISTAKES = {  # case: (environment, pipeline.yaml addition, what the error must say)
    "unknown backend": (
        {"NEXA_TEACHER_BACKEND": "vllm"},
        "",
        "NEXA_TEACHER_BACKEND: unknown LLM backend 'vllm'; one of local, managed, openai",
    ),
    "a URL for the local backend": (
        {"NEXA_JUDGE_URL": "http://127.0.0.1:8000/v1"},
        "",
        "NEXA_JUDGE_URL: base_url is not a setting of the local backend (LocalLLM",
    ),
    "openai without a URL": (
        {"NEXA_TEACHER_BACKEND": "openai"},
        "",
        "NEXA_TEACHER_URL: the openai backend needs base_url",
    ),
    "another backend's key in the file": (
        {},
        "judge_llm:\n  backend: managed\n  batch_size: 4\n",
        "pipeline.yaml: judge_llm.batch_size: batch_size is not a setting of the managed backend (ManagedLLM",
    ),
    "a key in the file": (
        {},
        "teacher_llm:\n  backend: openai\n  base_url: http://x/v1\n  api_key: sk-1\n",
        "pipeline.yaml: teacher_llm.api_key: never a key in a configuration file: set NEXA_TEACHER_API_KEY_FILE",
    ),
    "a key file that cannot be read": (
        {
            "NEXA_TEACHER_BACKEND": "openai",
            "NEXA_TEACHER_URL": "http://x/v1",
            "NEXA_TEACHER_API_KEY_FILE": "/nonexistent/teacher-key",
        },
        "",
        "NEXA_TEACHER_API_KEY_FILE=/nonexistent/teacher-key: the file cannot be read ([Errno 2]",
    ),
    "a key both as a file and as a value": (
        {
            "NEXA_JUDGE_BACKEND": "openai",
            "NEXA_JUDGE_URL": "http://x/v1",
            "NEXA_JUDGE_API_KEY": "sk-1",
            "NEXA_JUDGE_API_KEY_FILE": "/run/secrets/judge",
        },
        "",
        "NEXA_JUDGE_API_KEY and NEXA_JUDGE_API_KEY_FILE are both set: keep one (the file)",
    ),
    "a bad value": (
        {"NEXA_TEACHER_BACKEND": "managed"},
        "teacher_llm:\n  max_concurrency: 0\n",
        "pipeline.yaml: teacher_llm.max_concurrency: Input should be greater than or equal to 1 (got 0)",
    ),
}


@pytest.mark.parametrize("case", sorted(LLM_MISTAKES))
def test_a_wrong_llm_backend_or_another_backends_field_fails_the_load(
    case: str, tmp_path, monkeypatch
) -> None:
    """``LLMResource`` used to take every backend's fields and a free ``backend`` string, checked at run time."""
    from nexa_dagster.core.common.config import ConfigError
    from nexa_dagster.definitions import build_defs

    environment, addition, expected = LLM_MISTAKES[case]
    configs = _configs_with(tmp_path, "pipeline.yaml", "schedule:", addition + "schedule:")
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
    for key in [k for k in os.environ if k.startswith(("NEXA_TEACHER_", "NEXA_JUDGE_"))]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as raised:
        build_defs()
    assert expected in str(raised.value)


def test_each_llm_backend_gets_its_own_resource_class(tmp_path, monkeypatch) -> None:
    """pipeline.yaml names the teacher's backend and its fields; the environment overrides; the key is an EnvVar."""
    from nexa_dagster.definitions import build_defs
    from nexa_dagster.resources.llm import LocalLLM, ManagedLLM, OpenAILLM

    configs = _configs_with(
        tmp_path,
        "pipeline.yaml",
        "schedule:",
        "teacher_llm:\n  backend: managed\n  max_concurrency: 3\n  continuous_batching: false\n"
        "judge_llm:\n  batch_size: 4\nschedule:",
    )
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
    for key in [k for k in os.environ if k.startswith(("NEXA_TEACHER_", "NEXA_JUDGE_"))]:
        monkeypatch.delenv(key)
    resources = build_defs().resources
    teacher, judge = resources["teacher_llm"], resources["judge_llm"]
    assert (
        type(teacher) is ManagedLLM and teacher.max_concurrency == 3 and teacher.continuous_batching is False
    )
    assert type(judge) is LocalLLM and judge.batch_size == 4 and judge.model.endswith("models/tiny-teacher")

    monkeypatch.setenv("NEXA_TEACHER_BACKEND", "openai")
    monkeypatch.setenv("NEXA_TEACHER_URL", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("NEXA_TEACHER_API_KEY", "sk-not-in-metadata")
    with pytest.raises(Exception, match="continuous_batching is not a setting of the openai backend"):
        build_defs()  # the file's managed-only keys do not fit the backend the environment picks
    (configs / "pipeline.yaml").write_text(
        (configs / "pipeline.yaml")
        .read_text()
        .replace("  max_concurrency: 3\n  continuous_batching: false\n", "  max_concurrency: 3\n")
    )
    teacher = build_defs().resources["teacher_llm"]
    assert type(teacher) is OpenAILLM and teacher.max_concurrency == 3 and teacher.model == ""
    assert isinstance(teacher.api_key, dg.EnvVar) and teacher.api_key.env_var_name == "NEXA_TEACHER_API_KEY"
    assert "sk-not-in-metadata" not in str(teacher.describe())

    # the key as a file (a Docker or Kubernetes secret): its path is the config, the key is read when a client opens
    monkeypatch.delenv("NEXA_TEACHER_API_KEY")
    key_file = tmp_path / "teacher-key"
    key_file.write_text("sk-from-a-file\n")
    monkeypatch.setenv("NEXA_TEACHER_API_KEY_FILE", str(key_file))
    teacher = build_defs().resources["teacher_llm"]
    assert type(teacher) is OpenAILLM and teacher.api_key == "" and teacher.api_key_file == str(key_file)
    assert teacher.key() == "sk-from-a-file" and teacher.describe()["api_key_set"] is True
    assert "sk-from-a-file" not in str(teacher.describe())
