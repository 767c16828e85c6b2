"""Standard benchmarks with lm-evaluation-harness, run by the evaluation worker on every evaluated model.

The tasks are named in the scale preset (``evaluation.benchmarks``, ``config.BenchmarkSettings``) and run offline
from local files: the harness's own ``dataset_path: json`` with ``dataset_kwargs.data_files`` (a relative data file
is relative to its task YAML's folder: the worker runs in a scratch folder, so ``resolve_tasks`` makes it absolute),
or a Hugging Face dataset already in the local cache with ``HF_DATASETS_OFFLINE=1``. The model is loaded by the
harness itself: its ``hf`` backend on the checkpoint directory (in the worker process), or its ``vllm`` backend in
the vLLM environment (``make vllm`` installs the same harness there; ``lm_eval_on_vllm.py`` runs it, on a CPU host
or a GPU host alike).

``resolve_tasks`` runs before any model is loaded, so a misspelt task or a missing data file fails in seconds,
naming the task and the file, not after minutes of loading. Scores keep the harness's standard errors;
``compare_benchmark`` turns the candidate's and production's into a difference with an interval that the
promotion gate can use (``promotion.decide`` with ``metric: benchmark:<task>/<metric>``).
"""

from __future__ import annotations

import difflib
import json
import math
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from nexa_dagster import settings
from nexa_dagster.core.common.config import BenchmarkSettings, resolve_path
from nexa_dagster.core.common.spans import span
from nexa_dagster.core.evaluation.lm_eval_on_vllm import without_environment_probe
from nexa_dagster.core.llm import vllm_env

BENCHMARK_METRIC_PREFIX = "benchmark:"


class BenchmarkError(ValueError):
    """A benchmark that cannot run as configured (unknown task, missing data file, backend not installed)."""


@dataclass
class ResolvedTasks:
    """What ``run_benchmarks`` passes to the harness: its task manager and one spec (name or config) per task."""

    manager: Any  # lm_eval.tasks.TaskManager
    specs: list[str | dict[str, Any]]
    names: list[str]
    include_path: list[str] = field(
        default_factory=list
    )  # what the manager was built with (the vllm backend's
    include_defaults: bool = False  # process builds its own from these)


def _offline_env() -> None:
    # the worker never reaches a hub: every dataset is a local file or already cached
    settings.export_default(settings.HF_HUB_OFFLINE)
    settings.export_default(settings.HF_DATASETS_OFFLINE)


def _local_data(name: str, cfg: dict[str, Any], yaml_path: Path | None) -> dict[str, Any] | None:
    """The task's config with its relative ``data_files`` made absolute (None when it names none); raises
    ``BenchmarkError`` naming the task, its YAML and the file when a data file or local dataset folder is missing."""
    where = f"benchmark task {name!r} ({yaml_path or 'inline config'})"
    base = yaml_path.parent if yaml_path else Path.cwd()
    dataset_path = str(cfg.get("dataset_path") or "")
    if dataset_path.startswith(("/", "./", "../")) and not (base / dataset_path).exists():
        raise BenchmarkError(f"{where}: dataset_path {dataset_path} does not exist")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if not files:
        return None

    def absolute(path: str) -> str:
        full = path if "://" in path else str((base / path).resolve())
        if "://" not in full and not Path(full).exists():
            raise BenchmarkError(f"{where}: data file {full} does not exist")
        return full

    if isinstance(files, str):
        resolved: Any = absolute(files)
    elif isinstance(files, list):
        resolved = [absolute(f) for f in files]
    else:
        resolved = {
            split: [absolute(f) for f in v] if isinstance(v, list) else absolute(v)
            for split, v in files.items()
        }
    return {**cfg, "dataset_kwargs": {**cfg["dataset_kwargs"], "data_files": resolved}}


def resolve_tasks(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> ResolvedTasks:
    """Find every configured task and check its data, before a model is loaded.

    The harness's own tasks (~15k YAMLs, half a minute to index on a busy 2-core machine) are indexed only when a
    name is not among ``include_path``'s."""
    _offline_env()
    # seconds to import, only when benchmarks run: not at the code location's load
    from lm_eval.tasks import TaskManager

    paths = [resolve_path(p) for p in settings.include_path]
    for path in paths:
        if not path.is_dir():
            raise BenchmarkError(f"benchmarks include_path {path} is not a folder")
    manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False) if paths else None
    include_defaults = manager is None or any(name not in manager.all_tasks for name in settings.tasks)
    if include_defaults:
        log("indexing lm-evaluation-harness's own tasks")
        manager = TaskManager(include_path=[str(p) for p in paths] or None)
    unknown = [name for name in settings.tasks if name not in manager.all_tasks]
    if unknown:
        hints = {name: difflib.get_close_matches(name, manager.all_tasks, n=3) for name in unknown}
        raise BenchmarkError(
            "unknown benchmark task(s): "
            + "; ".join(
                f"{name!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for name, h in hints.items()
            )
            + f". Known: the harness's tasks and the YAMLs under {', '.join(map(str, paths)) or 'no include_path'}"
        )
    specs: list[str | dict[str, Any]] = []
    for name in settings.tasks:
        entry = manager.task_index[name]
        local = (
            _local_data(name, dict(entry.cfg), entry.yaml_path) if entry.cfg and "task" in entry.cfg else None
        )
        specs.append(local if local is not None else name)
    if settings.backend == "vllm":
        _harness_in_vllm_env()  # one line saying how to install it, before any model loads
    return ResolvedTasks(manager, specs, list(settings.tasks), [str(p) for p in paths], include_defaults)


def _harness_in_vllm_env() -> Path:
    """The vLLM environment's interpreter, where the harness is installed beside vLLM, or a ``BenchmarkError``."""
    python = vllm_env.vllm_python()
    if python is None or not (vllm_env.installed_versions() or {}).get("lm_eval"):
        raise BenchmarkError(
            f"benchmarks backend 'vllm' needs vLLM and lm-evaluation-harness in the vLLM environment "
            f"{vllm_env.env_dir()}: {vllm_env.INSTALL_HINT}; or use backend: hf"
        )
    return python


def _model_args(settings: BenchmarkSettings, model_dir: str, device: str) -> dict[str, Any]:
    if (
        settings.backend == "vllm"
    ):  # on a CPU: float32 (the checkpoints' dtype) and eager mode, as serving runs it
        cpu = {} if device == "cuda" else {"dtype": "float32", "enforce_eager": True}
        return {"pretrained": model_dir, "dtype": "auto", "seed": 0, **cpu, **settings.model_args}
    return {
        "pretrained": model_dir,
        "device": device,
        "dtype": "auto" if device == "cuda" else "float32",
        **settings.model_args,
    }


def run_benchmarks(
    model_dir: str,
    settings: BenchmarkSettings,
    tasks: ResolvedTasks,
    device: str = "cpu",
    log: Callable[[str], None] = print,
    label: str = "model",
) -> dict[str, Any]:
    """Run the resolved tasks on one checkpoint directory; ``{"tasks": {task: {metric: {value, stderr,
    higher_is_better}}}, "samples": {task: n}, "lm_eval_version": ...}``."""
    _offline_env()
    import lm_eval  # as in resolve_tasks

    log(
        f"{label}: benchmarks {', '.join(tasks.names)} (lm-evaluation-harness {lm_eval.__version__}, "
        f"{settings.backend} backend)"
    )
    if settings.backend == "vllm":
        out = _evaluate_on_vllm(model_dir, settings, tasks, device, label)
    else:
        out = _evaluate_here(model_dir, settings, tasks, device, log)
    if out is None:  # only on a non-zero rank of a multi-process run
        raise BenchmarkError("lm-evaluation-harness returned no results")
    scores = parse_results(out)
    for task, metrics in scores["tasks"].items():
        log(
            f"{label}: {task}: "
            + ", ".join(
                f"{m} {v['value']:.4f}" + (f" ± {v['stderr']:.4f}" if v["stderr"] is not None else "")
                for m, v in metrics.items()
            )
        )
    return scores


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None  # the harness writes "N/A" for a stderr it could not compute
    return number if math.isfinite(number) else None


def _evaluate_here(
    model_dir: str, settings: BenchmarkSettings, tasks: ResolvedTasks, device: str, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """The harness in this process, its model built first: what ``simple_evaluate`` builds from a backend's name
    and a dict of arguments (``create_from_arg_obj`` with its batch size, no device or batch-size limit of its
    own), built here so that its load (lm-evaluation-harness loads a copy of its own) is a fixed cost apart from
    the tasks' scoring, the work, in the pipeline profile's spans."""
    import lm_eval.api.registry  # as in resolve_tasks (it binds lm_eval too)

    model_args = _model_args(settings, model_dir, device)
    with span(log, "fixed", "model_load"):
        lm = lm_eval.api.registry.get_model(settings.backend).create_from_arg_obj(
            model_args, {"batch_size": settings.batch_size, "max_batch_size": None, "device": None}
        )
    with span(log, "work", "benchmarks"), without_environment_probe():
        return lm_eval.simple_evaluate(
            model=lm,
            model_args=model_args,
            tasks=tasks.specs,
            task_manager=tasks.manager,
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            batch_size=settings.batch_size,
            log_samples=False,
            bootstrap_iters=settings.bootstrap_iters,
        )


def _evaluate_on_vllm(
    model_dir: str, bench: BenchmarkSettings, tasks: ResolvedTasks, device: str, label: str
) -> dict[str, Any]:
    """The harness's vllm backend in the vLLM environment (``lm_eval_on_vllm.py``) on one request file; the last
    lines of its output quoted when it fails."""
    python = _harness_in_vllm_env()
    request = {
        "specs": tasks.specs,
        "include_path": tasks.include_path,
        "include_defaults": tasks.include_defaults,
        "model_args": _model_args(bench, model_dir, device),
        "num_fewshot": bench.num_fewshot,
        "limit": bench.limit,
        "batch_size": bench.batch_size,
        "bootstrap_iters": bench.bootstrap_iters,
    }
    try:
        body = json.dumps(request)
    except TypeError as e:  # a task config holding a Python function (YAML's !function)
        raise BenchmarkError(
            f"benchmarks backend 'vllm' passes task configs as JSON, and one of {tasks.names} holds what JSON "
            f"cannot ({e}): name the task instead, or use backend: hf"
        ) from None
    with tempfile.TemporaryDirectory(prefix="lm-eval-vllm-") as tmp:
        request_path, result_path, log_path = (
            Path(tmp) / n for n in ("request.json", "result.json", "log.txt")
        )
        request_path.write_text(body, encoding="utf-8")
        script = Path(__file__).with_name("lm_eval_on_vllm.py")
        env = _harness_environ(device)
        with open(log_path, "wb") as log:
            code = subprocess.run(
                [str(python), str(script), str(request_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                check=False,
            ).returncode
        if code != 0 or not result_path.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise BenchmarkError(
                f"{label}: lm-evaluation-harness on vLLM {vllm_env.VLLM_RELEASE} exited with code {code}; "
                f"its last lines:\n{tail}"
            )
        return json.loads(result_path.read_text(encoding="utf-8"))


def _harness_environ(device: str) -> dict[str, str]:
    """The environment of the harness's process in the vLLM environment."""
    return {
        **settings.child_environ("engine"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        **vllm_env.ONE_PROCESS,  # the engine core in the harness's process (core/llm/vllm_engine.py: why)
        # the CPU build is told it is one: vLLM finds it from version("vllm") naming "cpu", which the harness's
        # stand-in for the CPU build's version does not (lm_eval_on_vllm.py)
        **({} if device == "cuda" else {"VLLM_TARGET_DEVICE": "cpu"}),
        settings.VLLM_CPU_KVCACHE_SPACE.name: settings.VLLM_CPU_KVCACHE_SPACE.get(),
    }


def parse_results(out: dict[str, Any]) -> dict[str, Any]:
    """The harness's ``results`` as ``{task: {metric: {value, stderr, higher_is_better}}}``; a metric under a
    filter other than ``none`` is named ``metric.filter`` (``exact_match.first_three_words``)."""
    tasks: dict[str, dict[str, dict[str, Any]]] = {}
    for task, row in out["results"].items():
        better = out.get("higher_is_better", {}).get(task, {})
        metrics: dict[str, dict[str, Any]] = {}
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_name = key.split(",", 1)
            number = _number(value)
            if number is None:
                continue
            name = metric if filter_name == "none" else f"{metric}.{filter_name}"
            metrics[name] = {
                "value": number,
                "stderr": _number(row.get(f"{metric}_stderr,{filter_name}")),
                "higher_is_better": bool(better.get(metric, True)),
            }
        if metrics:
            tasks[task] = metrics
    return {
        "tasks": tasks,
        "samples": {
            t: int(v.get("effective", v.get("original", 0))) if isinstance(v, dict) else int(v)
            for t, v in out.get("n-samples", {}).items()
        },
        "lm_eval_version": out.get("lm_eval_version"),
    }


def flat_scores(scores: dict[str, Any] | None) -> dict[str, float | None]:
    """``{"<task>/<metric>": value, "<task>/<metric>_stderr": stderr}``: for metadata, MLflow and the leaderboard."""
    flat: dict[str, float | None] = {}
    for task, metrics in ((scores or {}).get("tasks") or {}).items():
        for metric, v in metrics.items():
            flat[f"{task}/{metric}"] = v["value"]
            flat[f"{task}/{metric}_stderr"] = v["stderr"]
    return flat


def parse_metric(metric: str) -> tuple[str, str]:
    """``benchmark:<task>/<metric>`` -> (task, metric)."""
    task, _, name = metric.removeprefix(BENCHMARK_METRIC_PREFIX).partition("/")
    if not metric.startswith(BENCHMARK_METRIC_PREFIX) or not task or not name:
        raise ValueError(
            f"a benchmark metric is written {BENCHMARK_METRIC_PREFIX}<task>/<metric> "
            f"(e.g. benchmark:nexa_stdlib_module/acc), not {metric!r}"
        )
    return task, name


@dataclass(frozen=True)
class BenchmarkComparison:
    """One benchmark metric of the candidate and of production, and the difference (better is positive)."""

    metric: str
    candidate: float
    production: float
    difference: float  # candidate - production, sign flipped for a lower-is-better metric
    low: float
    high: float
    confidence: float
    higher_is_better: bool
    samples: int = 0  # the fewer of the two runs' harness samples of the task: the n the interval rests on


def _score(scores: dict[str, Any] | None, task: str, metric: str, who: str) -> dict[str, Any]:
    try:
        return scores["tasks"][task][metric]  # type: ignore[index]
    except (KeyError, TypeError):
        raise BenchmarkError(f"{who} has no benchmark score {task}/{metric}") from None


def compare_benchmark(
    metric: str, candidate: dict[str, Any] | None, production: dict[str, Any] | None, confidence: float = 0.95
) -> BenchmarkComparison:
    """The difference of one metric with a normal interval from both models' harness standard errors (the two
    runs are scored independently here: their errors add, which is conservative for the same examples)."""
    task, name = parse_metric(metric)
    c, p = _score(candidate, task, name, "the candidate"), _score(production, task, name, "production")
    sign = 1.0 if c["higher_is_better"] else -1.0
    diff = sign * (c["value"] - p["value"])
    se = math.sqrt((c["stderr"] or 0.0) ** 2 + (p["stderr"] or 0.0) ** 2)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return BenchmarkComparison(
        f"{task}/{name}",
        c["value"],
        p["value"],
        diff,
        diff - z * se,
        diff + z * se,
        confidence,
        c["higher_is_better"],
        samples=min(_samples(candidate, task), _samples(production, task)),
    )


def _samples(scores: dict[str, Any] | None, task: str) -> int:
    """The harness's sample count of ``task`` in one run (0 when it did not say)."""
    return int(((scores or {}).get("samples") or {}).get(task, 0))


def markdown_table(candidate: dict[str, Any] | None, production: dict[str, Any] | None = None) -> list[str]:
    """The report's benchmark table (empty when none ran)."""
    rows = (candidate or {}).get("tasks") or {}
    if not rows:
        return []
    prod = (production or {}).get("tasks") or {}
    lines = [
        "## Benchmarks (lm-evaluation-harness)",
        "",
        "| task | metric | value | stderr | production |",
        "|---|---|---|---|---|",
    ]
    for task, metrics in rows.items():
        for metric, v in metrics.items():
            se = f"{v['stderr']:.4f}" if v["stderr"] is not None else "n/a"
            other = prod.get(task, {}).get(metric)
            lines.append(
                f"| {task} | {metric} | {v['value']:.4f} | {se} | {other['value']:.4f} |"
                if other
                else f"| {task} | {metric} | {v['value']:.4f} | {se} | |"
            )
    return [*lines, ""]
