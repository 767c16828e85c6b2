"""An engine behind the serving endpoint listens on a Unix socket, never on a TCP port: the command lines that
start it (vLLM's own ``--uds``; ``transformers serve`` through serve_on_unix_socket.py, which imports nothing of
this package). The engine started for real on its socket: tests/integration/test_serving_endpoint.py."""

from __future__ import annotations

import ast
from pathlib import Path

from nexa_dagster.core.llm.managed_server import ON_UNIX_SOCKET, server_command


def test_an_engine_on_a_socket_is_given_no_host_or_port(tmp_path: Path) -> None:
    sock = tmp_path / "blue.sock"
    vllm = server_command("/m", 9001, "vllm", served_model_name="nexa-moe", socket_path=sock)
    assert vllm[vllm.index("--uds") + 1] == str(sock)
    hf = server_command("/m", 9001, "transformers", socket_path=sock)
    assert hf[1:5] == [str(ON_UNIX_SOCKET), str(sock), "serve", "/m"]
    for cmd in (vllm, hf):
        assert "--host" not in cmd and "--port" not in cmd and "9001" not in cmd, cmd
    on_port = server_command("/m", 9001, "transformers")
    assert on_port[on_port.index("--host") + 1] == "127.0.0.1" and "--uds" not in on_port


def test_the_socket_launcher_imports_nothing_of_the_package() -> None:
    """Run as a script in every engine: importing nexa_dagster (and Dagster with it) would slow every start."""
    tree = ast.parse(ON_UNIX_SOCKET.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert imported == {"sys", "uvicorn", "transformers"}, imported
