"""Every configuration file checked at once, when the code location loads.

A typo used to surface late or never: an unknown key was ignored (``acelerator: cuda`` trained on CPU), a missing
one was a bare ``KeyError`` at run time, and a scale preset that the current ``NEXA_SCALE`` does not select passed
``make validate`` and failed the night it was chosen. ``check_configs`` reads every file under ``configs/`` that the
pipeline reads, against its typed model (pydantic, ``extra="forbid"``), follows the references between them (a
scale's model preset and DeepSpeed file, packaging's blends), and raises one ``ConfigError`` listing every problem
with its file and key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from nexa_dagster.core.common.config import (
    ConfigError,
    config_dir,
    load_deepspeed_config,
    load_model_preset,
    load_scale,
    pipeline_config,
)
from nexa_dagster.core.distill.sample_gate import load_gate_config
from nexa_dagster.core.evaluation.benchmarks import parse_metric
from nexa_dagster.core.evaluation.promotion import load_policy
from nexa_dagster.core.packaging.blend import DataBlend, load_packaging_config


def _problems(extra: Sequence[Callable[[], object]]) -> list[str]:

    root = config_dir()
    problems: list[str] = []

    def check(load: Callable[[], object]) -> object | None:
        try:
            return load()
        except (ConfigError, FileNotFoundError, ValueError) as e:
            problems.append(str(e))
            return None

    if check(pipeline_config) is not None:
        for more in extra:  # what is built from pipeline.yaml (the resources), once the file itself is valid
            check(more)
    for path in sorted((root / "scales").glob("*.yaml")):
        scale = check(lambda p=path: load_scale(p.stem))
        if scale is None:
            continue
        where = f"{path}: "
        if not (root / "models" / f"{scale.model_preset}.yaml").is_file():
            problems.append(
                f"{where}model_preset: {scale.model_preset!r} names no file configs/models/"
                f"{scale.model_preset}.yaml"
            )
        try:
            load_deepspeed_config(scale.deepspeed_config)
        except FileNotFoundError:
            problems.append(
                f"{where}deepspeed_config: {scale.deepspeed_config!r} names no file configs/deepspeed/"
                f"{scale.deepspeed_config}"
            )
        except json.JSONDecodeError as e:
            problems.append(f"{root / 'deepspeed' / scale.deepspeed_config}: invalid JSON ({e})")
    for path in sorted((root / "models").glob("*.yaml")):
        check(lambda p=path: load_model_preset(p.stem))
    policy = check(load_policy)
    if policy is not None and policy.benchmark:  # the gate's benchmark must be one the current scale runs
        task, _ = parse_metric(policy.metric)
        scale = check(load_scale)
        if scale is not None and task not in scale.evaluation.benchmarks.tasks:
            problems.append(
                f"{root / 'promotion.yaml'}: metric: {policy.metric!r} names task {task!r}, which "
                f"scale {scale.name!r} does not run (evaluation.benchmarks.tasks: "
                f"{scale.evaluation.benchmarks.tasks})"
            )
    for path in sorted(root.glob("filters*.yaml")):
        check(lambda p=path: load_gate_config(p.name))
    packaging = check(load_packaging_config)
    blends = {p.relative_to(root).as_posix() for p in (root / "blends").glob("*.yaml")}
    if packaging is not None:
        blends |= {packaging.sft_blend, packaging.pretrain_blend, packaging.rl_blend}
    for blend in sorted(blends):
        check(lambda b=blend: DataBlend.load(b))
    return problems


def check_configs(extra: Sequence[Callable[[], object]] = ()) -> None:
    """Raise one ``ConfigError`` naming every bad file and key under ``configs/`` (nothing when all are valid).

    ``extra``: more checks that raise ``ConfigError`` (the code location passes the building of its resources,
    which checks ``gpu_cluster`` against the class of its backend).
    """
    problems = _problems(extra)
    if problems:
        lines = [line for problem in problems for line in problem.splitlines()]
        raise ConfigError(f"{len(lines)} configuration problem(s):\n  " + "\n  ".join(lines))
