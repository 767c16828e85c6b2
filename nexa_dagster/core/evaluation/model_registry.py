"""A checkpoint as an MLflow ``transformers`` model: what the registry holds is the model, not a path to it.

``log_checkpoint_model`` writes the checkpoint (weights, config, generation config, tokenizer with its chat
template) in the ``transformers`` flavor's ``MLmodel`` layout and uploads it as the run's ``model`` artifact, through
the tracking client, so it lands wherever the run's artifacts live: a local ``mlartifacts`` folder with the default
SQLite store, the server's artifact store (``mlflow-artifacts:/...``) behind an ``mlflow server``. The version is
registered from ``runs:/<run_id>/model``, which any client of the same tracking server resolves, so
``mlflow.transformers.load_model("models:/nexa-moe@production")`` and ``mlflow models serve`` work from anywhere.

With ``transformers`` 5.x and MLflow 3.17 the flavor's path-based form (``transformers_model=<directory>``) fails
inside MLflow (it reads ``__name__`` of a task implementation that transformers 5 gives as a string), and its
default requirement inference imports ``torchvision``; the component form with explicit requirements works.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

MODEL_ARTIFACT = "model"
TASK = "text-generation"


def pip_requirements() -> list[str]:
    """What ``mlflow models serve`` installs to serve the model: the versions it was logged with."""
    # accelerate, torch and transformers take seconds to import, only when a model is registered: not at the
    # code location's load
    import accelerate
    import torch
    import transformers

    return [
        f"transformers=={transformers.__version__}",
        f"torch=={torch.__version__.split('+')[0]}",
        f"accelerate=={accelerate.__version__}",
    ]


def save_checkpoint_model(checkpoint_dir: str | Path, out_dir: str | Path) -> None:
    """Write the checkpoint at ``checkpoint_dir`` as an MLflow ``transformers`` model in ``out_dir`` (new)."""
    # mlflow's transformers flavour and transformers take seconds to import: not at the code location's load
    import mlflow.transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").exists():
        raise FileNotFoundError(
            f"checkpoint {checkpoint_dir} has no config.json: not a Hugging Face model "
            "directory, nothing to log to the model registry"
        )
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    mlflow.transformers.save_model(
        transformers_model={"model": model, "tokenizer": tokenizer},
        path=str(out_dir),
        task=TASK,
        pip_requirements=pip_requirements(),
    )


def log_checkpoint_model(client: Any, run_id: str, checkpoint_dir: str | Path) -> str:
    """Upload the checkpoint as run ``run_id``'s ``model`` artifact; returns its ``runs:/`` URI."""
    with tempfile.TemporaryDirectory(prefix="nexa-mlflow-model-") as tmp:
        out = Path(tmp) / MODEL_ARTIFACT
        save_checkpoint_model(checkpoint_dir, out)
        client.log_artifacts(run_id, str(out), artifact_path=MODEL_ARTIFACT)
    return f"runs:/{run_id}/{MODEL_ARTIFACT}"
