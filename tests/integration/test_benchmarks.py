"""Standard benchmarks in evaluation: the real lm-evaluation-harness (0.4.13) in the evaluation worker, offline.

The two shipped tasks (``configs/benchmarks/nexa_stdlib/``, built from CPython's docstrings) run through the worker
process on the tiny checkpoint with the harness's ``hf`` backend; their scores and standard errors reach the
report; the promotion gate can decide on one; and a task that cannot run fails before any model is loaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from support.worker_launch import run_worker_command

from nexa_dagster.core.common.config import REPO_ROOT, BenchmarkSettings, ConfigError
from nexa_dagster.core.evaluation.benchmarks import BenchmarkComparison, compare_benchmark, flat_scores
from nexa_dagster.core.evaluation.eval_set import freeze_eval_set, load_eval_set
from nexa_dagster.core.evaluation.promotion import ProductionEntry, PromotionPolicy, decide
from nexa_dagster.core.evaluation.scoring import EvalResult, ModelScores, write_report
from nexa_dagster.core.evaluation.worker import EvaluationJob
from nexa_dagster.resources.gpu_cluster import LocalGPUCluster

SHIPPED = ["nexa_stdlib_module", "nexa_docstring_completion"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def eval_set(tiny_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    n = 24
    samples = pd.DataFrame(
        {
            "sample_id": [f"id{i:03d}" for i in range(n)],
            "day": ["2026-11-20"] * n,
            "system_prompt": ["Be brief."] * n,
            "prompt": [f"What is {i} + 1?" for i in range(n)],
            "response": [f"It is {i + 1}." for i in range(n)],
        }
    )
    root = tmp_path_factory.mktemp("bench_evalset")
    freeze_eval_set(samples, tiny_tokenizer, str(root / "eval_sets"), 1, 0.5, 128, log=lambda m: None)
    return load_eval_set(str(root / "eval_sets"), 1)


def _worker(job: EvaluationJob, tmp_path: Path) -> subprocess.CompletedProcess:
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    # run where the Dagster resource runs it: in a scratch folder, not the repo (relative data files must resolve)
    return run_worker_command(
        [sys.executable, "-m", "nexa_dagster.core.evaluation.worker", "--job", str(job_file)],
        env=OFFLINE,
        timeout=600,
        cwd=tmp_path,
    )


def _job(model: Path | str, eval_set: dict, tmp_path: Path, settings: BenchmarkSettings) -> EvaluationJob:
    return EvaluationJob(
        run_id="bench",
        models={"candidate": str(model)},
        examples_path=eval_set["path"],
        eval_set_version=1,
        prompts=["What is 1 + 1?"],
        max_new_tokens=4,
        output_path=str(tmp_path / "scores.json"),
        benchmarks=settings.model_copy(
            update={"include_path": [str(REPO_ROOT / p) for p in settings.include_path]}
        ),
    )


def test_the_shipped_benchmarks_run_offline_in_the_worker_and_reach_the_report(
    tiny_model_dir: Path, eval_set: dict, tmp_path: Path
) -> None:
    """Both shipped tasks, every example, on the tiny checkpoint: accuracy and exact match with the harness's
    standard errors in the worker's scores, the JSON report and the Markdown report."""
    proc = _worker(_job(tiny_model_dir, eval_set, tmp_path, BenchmarkSettings(tasks=SHIPPED)), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = ModelScores.from_json(json.loads((tmp_path / "scores.json").read_text())["scores"]["candidate"])
    bench = scores.benchmarks
    assert bench["lm_eval_version"] == "0.4.13" and bench["samples"] == {t: 40 for t in SHIPPED}
    mc = bench["tasks"]["nexa_stdlib_module"]
    for metric in ("acc", "acc_norm"):
        # 40 examples, four choices: a mean of 0/1 values whose stderr is sqrt(p(1-p)/(n-1)), > 0 unless all alike
        value, stderr = mc[metric]["value"], mc[metric]["stderr"]
        assert 0 <= value <= 1 and mc[metric]["higher_is_better"]
        assert stderr == pytest.approx((value * (1 - value) / 39) ** 0.5, rel=1e-6)
    gen = bench["tasks"]["nexa_docstring_completion"]["exact_match.first_three_words"]
    assert 0 <= gen["value"] <= 1 and gen["stderr"] is not None
    assert "bench candidate: nexa_stdlib_module: acc " in proc.stdout

    result = EvalResult("bench", scores.loss, [], scores.benchmarks)
    json_path, md_path = write_report(result, {}, str(tmp_path / "report"))
    report = json.loads(Path(json_path).read_text())
    assert report["benchmarks"]["tasks"]["nexa_stdlib_module"]["acc"] == mc["acc"]
    markdown = Path(md_path).read_text()
    assert f"| nexa_stdlib_module | acc | {mc['acc']['value']:.4f} | {mc['acc']['stderr']:.4f} |" in markdown
    flat = flat_scores(scores.benchmarks)
    assert flat["nexa_stdlib_module/acc"] == mc["acc"]["value"]
    assert flat["nexa_stdlib_module/acc_stderr"] == mc["acc"]["stderr"]

    # the gate on this benchmark: the same model against itself is a tie (held back), whatever its accuracy
    policy = PromotionPolicy(metric="benchmark:nexa_stdlib_module/acc")
    production = ProductionEntry(
        checkpoint_id="prod", checkpoint_path=str(tiny_model_dir), metric=policy.metric
    )
    tie = compare_benchmark(policy.metric, bench, bench)
    assert tie.difference == 0 and tie.low < 0 < tie.high
    held = decide("bench", production, policy, benchmark=tie)
    assert not held.passed and "nexa_stdlib_module/acc" in held.reason and "is not above 0.0" in held.reason


def test_a_bad_task_or_a_missing_data_file_fails_before_any_model_is_loaded(
    eval_set: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model folder is empty (it passes the cluster's check that the inputs exist, and no model loads from
    it): an error about the task, not the model, proves the task is checked first. A name not among include_path's
    is looked up among the harness's own ~15k tasks (indexing them is the slow part of this test), with the near
    names offered."""
    no_model = tmp_path / "no-such-checkpoint"
    no_model.mkdir()
    job = _job(no_model, eval_set, tmp_path, BenchmarkSettings(tasks=["nexa_stdlib_modul"]))

    # a typo fails the same way again: no retry (this file's annotations are strings, which Dagster cannot read)
    @dg.asset(retry_policy=dg.RetryPolicy(max_retries=2), required_resource_keys={"gpu_cluster"})
    def evaluated(context) -> None:  # noqa: ANN001
        context.resources.gpu_cluster.run_evaluation(context, job, tmp_path / "work")

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    result = dg.materialize(
        [evaluated],
        resources={"gpu_cluster": LocalGPUCluster()},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    events = result.all_events
    assert not [e for e in events if e.event_type_value == "STEP_UP_FOR_RETRY"], "a typo was retried"
    failure = next(
        e for e in events if e.event_type_value == "STEP_FAILURE"
    ).step_failure_data.user_failure_data
    assert (
        "unknown benchmark task(s): 'nexa_stdlib_modul' (did you mean nexa_stdlib_module"
        in failure.description
    )
    assert "not retried, it would fail again" in failure.description
    assert "scoring candidate" not in failure.description and "no-such-checkpoint" not in failure.description

    # a lab's task folder whose YAML names a data file that is not there (what the worker calls first, in-process)
    from nexa_dagster.core.evaluation.benchmarks import BenchmarkError, resolve_tasks

    tasks = tmp_path / "lab_tasks"
    tasks.mkdir()
    shutil.copy(REPO_ROOT / "configs/benchmarks/nexa_stdlib/stdlib_module.yaml", tasks / "stdlib_module.yaml")
    settings = BenchmarkSettings(tasks=["nexa_stdlib_module"], include_path=[str(tasks)])
    with pytest.raises(BenchmarkError) as error:
        resolve_tasks(settings, log=lambda m: None)
    assert str(error.value) == (
        f"benchmark task 'nexa_stdlib_module' ({tasks / 'stdlib_module.yaml'}): data file "
        f"{tasks / 'stdlib_module.jsonl'} does not exist"
    )
    shutil.copy(
        REPO_ROOT / "configs/benchmarks/nexa_stdlib/stdlib_module.jsonl", tasks / "stdlib_module.jsonl"
    )
    resolved = resolve_tasks(settings, log=lambda m: None)  # with the file there: the absolute path goes on
    assert resolved.specs[0]["dataset_kwargs"]["data_files"] == {"test": str(tasks / "stdlib_module.jsonl")}


def _scores(acc: float, stderr: float, samples: int = 500) -> dict:
    """A harness result of one task as the evaluation stores it (``samples``: the task's item count, the n the
    gate's evidence rule reads)."""
    return {
        "tasks": {"mmlu": {"acc": {"value": acc, "stderr": stderr, "higher_is_better": True}}},
        "samples": {"mmlu": samples},
    }


def test_the_gate_on_a_benchmark_needs_the_interval_from_the_harness_standard_errors() -> None:
    production = ProductionEntry(checkpoint_id="prod", checkpoint_path="/p", metric="benchmark:mmlu/acc")
    policy = PromotionPolicy(metric="benchmark:mmlu/acc")
    # +0.05 with stderrs 0.02 each: the 95% interval is 0.05 +- 1.96*0.0283 = [-0.0054, 0.1054], not clear of 0
    noisy = compare_benchmark(policy.metric, _scores(0.55, 0.02), _scores(0.50, 0.02))
    assert noisy.low == pytest.approx(0.05 - 1.959964 * (2 * 0.02**2) ** 0.5, abs=1e-6)
    assert not decide("c", production, policy, benchmark=noisy).passed
    assert decide(
        "c", production, PromotionPolicy(metric=policy.metric, require_interval=False), benchmark=noisy
    ).passed
    clear = compare_benchmark(policy.metric, _scores(0.60, 0.01), _scores(0.50, 0.01))
    assert decide("c", production, policy, benchmark=clear).passed
    assert not decide(
        "c", production, PromotionPolicy(metric=policy.metric, margin=0.1), benchmark=clear
    ).passed
    # a clear gain on a task of 10 items is no evidence: the gate refuses to decide on it
    few = compare_benchmark(policy.metric, _scores(0.60, 0.01, samples=10), _scores(0.50, 0.01, samples=10))
    refused = decide("c", production, policy, benchmark=few)
    assert not refused.passed and refused.decision == "insufficient evidence" and refused.n == 10, refused
    # lower-is-better metrics (a perplexity) count a reduction as the gain
    lower = {"tasks": {"mmlu": {"acc": {"value": 0.3, "stderr": 0.01, "higher_is_better": False}}}}
    assert isinstance(compare_benchmark(policy.metric, lower, _scores(0.5, 0.01)), BenchmarkComparison)
    assert compare_benchmark(policy.metric, lower, _scores(0.5, 0.01)).difference == pytest.approx(0.2)
    unmeasured = decide("c", production, policy)
    assert not unmeasured.passed and "nothing to compare with" in unmeasured.reason
    with pytest.raises(ValueError, match="benchmark:<task>/<metric>"):
        PromotionPolicy(metric="benchmark:mmlu")
    with pytest.raises(ValueError, match="eval_loss, win_rate or benchmark"):
        PromotionPolicy(metric="accuracy")


def test_a_gate_benchmark_the_scale_does_not_run_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    from nexa_dagster.config_check import check_configs

    configs = tmp_path / "configs"
    shutil.copytree(REPO_ROOT / "configs", configs)
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
    promotion = configs / "promotion.yaml"
    promotion.write_text(
        promotion.read_text().replace("metric: eval_loss", "metric: benchmark:nexa_stdlib_module/acc")
    )
    check_configs()  # the tiny scale runs it
    promotion.write_text(
        promotion.read_text().replace("benchmark:nexa_stdlib_module/acc", "benchmark:mmlu/acc")
    )
    with pytest.raises(ConfigError, match="names task 'mmlu', which scale 'tiny' does not run"):
        check_configs()
