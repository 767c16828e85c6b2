"""Start an OpenAI-compatible server on a local model for the duration of a block, and always stop it.

``vllm serve`` when vLLM is installed and a CUDA GPU is present, else ``transformers serve`` on the CPU. The
server runs in its own process group so that stopping it (SIGTERM, then SIGKILL after a grace period) also stops
any workers it spawned: no orphan processes after success, failure or cancellation.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from nexa_dagster.core.llm.base import LLMError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def server_command(model_dir: str, port: int, engine: str) -> list[str]:
    if engine == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", Path(model_dir).name]
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise LLMError("`transformers` CLI not found: install transformers[serving]")
    return [exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--log-level", "warning"]


class ManagedServer:
    """``with ManagedServer(model_dir, log_dir) as server: ... server.base_url ...``"""

    def __init__(self, model_dir: str | Path, log_dir: str | Path, engine: str = "auto",
                 startup_timeout_s: float = 180.0, port: int | None = None) -> None:
        self.model_dir = str(Path(model_dir).resolve())
        self.engine = ("vllm" if vllm_available() else "transformers") if engine == "auto" else engine
        self.port = port or free_port()
        self.log_path = Path(log_dir) / f"{self.engine}-serve-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model_name(self) -> str:
        """The name to put in requests: vLLM serves the directory's name, transformers the path itself."""
        return Path(self.model_dir).name if self.engine == "vllm" else self.model_dir

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def start(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = server_command(self.model_dir, self.port, self.engine)
        # `transformers serve` lists the hub cache on GET /v1/models and fails when there is none
        cache = Path(os.environ.get("HF_HUB_CACHE", self.log_path.parent / "hf-cache"))
        cache.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "HF_HUB_CACHE": str(cache)}
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # own process group, for a clean stop
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - t0
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise LLMError(f"{self.engine} server for {self.model_dir} exited with code "
                               f"{self.process.returncode} before becoming healthy; last log lines "
                               f"({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(health, timeout=2.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise LLMError(f"{self.engine} server at {health} not healthy after {self.startup_timeout_s:.0f} s; "
                       f"last log lines ({self.log_path}):\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        finally:
            # workers that outlived the leader of the group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
