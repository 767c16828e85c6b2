"""An engine behind the serving endpoint listens on a Unix socket, never on a TCP port: the command lines that
start it (vLLM's own ``--uds``; ``transformers serve`` through transformers_engine.py, which imports nothing of
this package); and that script's choice of how the model's process starts (forked only where that is safe). The
engine started for real on its socket: tests/integration/test_serving_endpoint.py; its model's process forked:
tests/integration/test_serving.py."""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from nexa_dagster.core.common.python_source import parse_python
from nexa_dagster.core.llm import transformers_engine
from nexa_dagster.core.llm.managed_server import TRANSFORMERS_ENGINE, server_command


def test_an_engine_on_a_socket_is_given_no_host_or_port(tmp_path: Path) -> None:
    sock = tmp_path / "blue.sock"
    vllm = server_command("/m", 9001, "vllm", served_model_name="nexa-moe", socket_path=sock)
    assert vllm[vllm.index("--uds") + 1] == str(sock)
    hf = server_command("/m", 9001, "transformers", socket_path=sock)
    assert hf[1:7] == [str(TRANSFORMERS_ENGINE), "--model-process", "fork", "--uds", str(sock), "serve"]
    for cmd in (vllm, hf):
        assert "--host" not in cmd and "--port" not in cmd and "9001" not in cmd, cmd
    on_port = server_command("/m", 9001, "transformers")
    assert on_port[on_port.index("--host") + 1] == "127.0.0.1" and "--uds" not in on_port
    assert on_port[1:4] == [
        str(TRANSFORMERS_ENGINE),
        "--model-process",
        "fork",
    ]  # a teacher's engine forks too
    with pytest.raises(ValueError, match="'fork' or 'spawn'"):
        server_command("/m", 9001, "transformers", model_process="forkserver")
    threads = server_command("/m", 9001, "transformers", model_threads="2")
    assert threads[1:6] == [str(TRANSFORMERS_ENGINE), "--model-process", "fork", "--model-threads", "2"]


def test_the_socket_launcher_imports_nothing_of_the_package() -> None:
    """Run as a script in every engine: importing nexa_dagster (and Dagster with it) would slow every start."""
    tree = parse_python(TRANSFORMERS_ENGINE.read_text(), str(TRANSFORMERS_ENGINE))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    stdlib = {"collections", "copy", "functools", "multiprocessing", "sys", "threading", "types", "typing"}
    # huggingface_hub: the command group transformers' own CLI is built on (serve_cli)
    assert imported - stdlib == {"uvicorn", "transformers", "torch", "huggingface_hub"}, imported


def test_the_engine_runs_transformers_serve_without_importing_the_other_commands() -> None:
    """``transformers serve ...`` parses as in transformers' own CLI (the same ``Serve`` command on the same group),
    but an engine's start imports none of the commands it never runs (libcst for ``add-new-model-like``, the chat
    client's rich): measured in a fresh interpreter, whose modules are its own."""
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import transformers_engine as t; app = t.serve_cli(); "
        "print(sorted(app.commands)); "
        "print(sorted(m for m in ('libcst', 'transformers.cli.chat', 'transformers.cli.add_new_model_like') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(TRANSFORMERS_ENGINE.parent)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert out[-2:] == ["['serve']", "[]"], out


@pytest.mark.parametrize(
    ("device", "threads", "method", "said"),
    [
        ("cpu", 1, "fork", "forked from the engine"),
        ("cuda", 1, "spawn", "on cuda"),  # a fork could copy a CUDA context
        ("", 1, "spawn", "on an unnamed device"),  # transformers serve's own `auto` may pick a GPU
        ("cpu", 3, "spawn", "runs 3 threads"),  # a fork could copy a lock another thread holds
    ],
)
def test_the_model_process_is_forked_only_on_a_cpu_from_a_single_thread(
    device: str, threads: int, method: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    start = transformers_engine.ModelProcessStart(device, None, threads=lambda: threads)
    assert start.get_context("spawn") is multiprocessing.get_context(method)
    assert said in capsys.readouterr().err
    assert start.get_context("forkserver") is multiprocessing.get_context(
        "forkserver"
    )  # only spawn is replaced
    assert start.Queue is multiprocessing.Queue  # the rest of the module as it is


def test_a_forked_model_process_gets_the_engines_thread_count_not_a_warm_pythons() -> None:
    """An engine forked from a warm Python has torch's pool of the warm Python (one thread); the model's process it
    forks must have the engine's ``OMP_NUM_THREADS`` (``--model-threads``), as a spawned one reads it."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the warm Python's
        transformers_engine.ModelProcessStart("cpu", 3, threads=lambda: 1).get_context("spawn")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
