"""lm-evaluation-harness's ``vllm`` backend (``evaluation.benchmarks.backend: vllm``): the harness in the vLLM
environment (``make vllm`` installs the project's release there) on the same checkpoint gives the ``hf`` backend's
scores within the harness's standard errors, on the configured tasks (a multiple-choice task scored by
log-likelihoods, a generation task scored by exact match).

The checkpoint: the project's pretrained tiny model with its heads widened 16 -> 32 (``core/llm/widen_heads``: the
same function, a head size vLLM's CPU attention takes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.vllm_install import require_vllm

from nexa_dagster.core.common.config import BenchmarkSettings
from nexa_dagster.core.evaluation.benchmarks import resolve_tasks, run_benchmarks

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-engine")]

TASKS = ["nexa_stdlib_module", "nexa_docstring_completion"]  # configs/scales/tiny.yaml's


def test_the_vllm_backend_gives_the_hf_backends_scores(tmp_path: Path) -> None:
    require_vllm()  # make test installs it beside the suite: wait for it (a failed install fails here)
    from nexa_dagster.core.llm.widen_heads import widen_checkpoint
    from nexa_dagster.core.tiny.pretrain import build_pretrained_tiny_lm

    model = str(widen_checkpoint(build_pretrained_tiny_lm(tmp_path / "tiny"), tmp_path / "tiny-h32", 32))
    scores = {}
    for backend in ("hf", "vllm"):
        bench = BenchmarkSettings(tasks=TASKS, backend=backend, limit=40)
        scores[backend] = run_benchmarks(model, bench, resolve_tasks(bench), label=backend)
    hf, vllm = scores["hf"], scores["vllm"]
    assert hf["samples"] == vllm["samples"] == {task: 40 for task in TASKS}
    assert set(hf["tasks"]) == set(vllm["tasks"]) == set(TASKS)
    accuracy = hf["tasks"]["nexa_stdlib_module"]["acc"]
    assert (
        0 < accuracy["value"] < 1 and accuracy["stderr"] > 0
    )  # a score that can differ: the comparison bites
    for task, metrics in hf["tasks"].items():
        for metric, value in metrics.items():
            other = vllm["tasks"][task][metric]
            print(
                f"{task}/{metric}: hf {value['value']:.4f} ± {value['stderr']:.4f}, vllm {other['value']:.4f}"
            )
            assert abs(value["value"] - other["value"]) <= (value["stderr"] or 0.0), (
                task,
                metric,
                value,
                other,
            )
    assert vllm["lm_eval_version"] == hf["lm_eval_version"]
