"""Start an OpenAI-compatible server on a local model for the duration of a block, and always stop it.

``vllm serve`` when vLLM is installed for this host (its own environment, ``vllm_env``: ``make vllm``) and can run
the model (``vllm_models``: not the tiny preset's head size on a CPU), else ``transformers serve``. The server runs in
its own process group so that stopping it (SIGTERM, then SIGKILL after a grace period) also stops any workers it
spawned: no orphan processes after success, failure or cancellation (KeyboardInterrupt, Dagster's run
termination). An ``atexit`` hook covers a server started without ``with``, and on Linux the server is also
told to stop (``PR_SET_PDEATHSIG``) when the process that started it is killed outright. That signal follows the
*thread* that started the server: start and stop it from the same thread, as ``with`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import http.client
import inspect
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from nexa_dagster import settings
from nexa_dagster.core.common.net import free_port
from nexa_dagster.core.llm import vllm_env
from nexa_dagster.core.llm.base import LLMError
from nexa_dagster.core.llm.vllm_models import refuse_unless_vllm_runs, why_vllm_cannot_run

if TYPE_CHECKING:
    import psutil

log = logging.getLogger(__name__)

_PORT_IN_USE = ("address already in use", "errno 98")
# Linux: the server gets SIGTERM if the process that started it dies without cleaning up (SIGKILL, OOM kill).
# Set in a tiny exec wrapper rather than a preexec_fn (unsafe with threads); the flag survives execv. The wrapper
# also lowers the CPU priority (argv[2], a nice increment) of what it execs, before that starts any thread (every
# thread inherits it), and, when it leads a session of its own, of its autogroup: with the kernel's autogroups on, a
# session competes with other sessions by its autogroup's nice, its threads' nice counting only among themselves.
_EXEC_WITH_PDEATHSIG = """\
import ctypes, os, signal, sys, time
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(143)  # the parent died before prctl took effect
if int(sys.argv[2]):
    os.nice(int(sys.argv[2]))
    for _ in range(40 if os.getsid(0) == os.getpid() else 0):  # a session (an autogroup) of its own only  # the kernel takes one autogroup change per 100 ms (EAGAIN) from an unprivileged user
        try:
            with open("/proc/self/autogroup", "w") as ag:
                ag.write(str(os.getpriority(os.PRIO_PROCESS, 0)))
            break
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:
            break  # no autogroups here
os.execv(sys.argv[3], sys.argv[3:])
"""


def with_parent_death_signal(cmd: Sequence[str], nice: int = 0) -> list[str]:
    """``cmd`` run through the wrapper above (Linux; elsewhere ``cmd`` as is): it dies with this process's thread
    that starts it, at ``nice`` more than this process's nice value."""
    if sys.platform != "linux":
        return list(cmd)
    return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), str(nice), *cmd]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # health checks never go via a proxy
TRANSFORMERS_ENGINE = Path(__file__).with_name("transformers_engine.py")


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (an engine without a TCP port)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def http_status(root: str, path: str, socket_path: str | None = None, timeout_s: float = 2.0) -> int:
    """The HTTP status of ``GET root + path`` (``root`` ignored with ``socket_path``); OSError when nothing answers."""
    if socket_path is None:
        try:
            with _NO_PROXY.open(root + path, timeout=timeout_s) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code
        except urllib.error.URLError as e:
            raise OSError(str(e.reason)) from None
    conn = _UnixHTTPConnection(socket_path, timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except http.client.HTTPException as e:
        raise OSError(str(e)) from None
    finally:
        conn.close()


def cuda_available() -> bool:
    try:
        import torch  # seconds to import, only when an engine is chosen: not at the code location's load

        return torch.cuda.is_available()
    except ImportError:
        return False


def vllm_available() -> bool:
    """vLLM is installed for this host's device (its own environment, ``vllm_env``; a GPU or a CPU build)."""
    return vllm_env.vllm_python() is not None


def choose_engine(model_dir: str | Path, engine: str) -> str:
    """The engine that serves ``model_dir``: ``engine`` as asked, ``auto`` = vLLM where it is installed and can
    run the model, else ``transformers``. Asked for ``vllm``, a host without it or a model it cannot run is an
    ``LLMError`` now (how to install it; why not and which engine can), not an engine that dies after its start."""
    if engine not in ("vllm", "transformers", "auto"):
        raise ValueError(f"unknown serving engine {engine!r}; use 'vllm', 'transformers' or 'auto'")
    if engine == "transformers":
        return engine
    device = vllm_env.device_kind()
    if engine == "auto":
        installed = vllm_available()
        runs = (
            installed and why_vllm_cannot_run(model_dir, device, vllm_env.supported_architectures()) is None
        )
        return "vllm" if runs else "transformers"
    vllm_env.require_vllm()
    refuse_unless_vllm_runs(model_dir, device, vllm_env.supported_architectures())
    return engine


@functools.cache
def transformers_serve_options() -> frozenset[str]:
    """The option names ``transformers serve`` accepts in the installed version (without running ``--help``).

    The CLI is a typer command built from ``Serve.__init__``'s signature, so the signature is the flag list.
    """
    try:
        from transformers.cli.serve import Serve  # optional (the serving extra), and seconds to import
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(Serve.__init__).parameters) - {"self"}


class ChildProcess(Protocol):
    """What the server's process must offer: a ``subprocess.Popen``, or a child forked from a warm Python."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class WarmInterpreter(Protocol):
    """A warm Python the server may fork from (``core/cluster/warm_python.WarmPython``, a later stage than this
    one: passed in, not imported)."""

    python: str

    def ready(self, timeout_s: float = ...) -> bool: ...

    def differs(self, env: Mapping[str, str]) -> list[str]: ...

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        cwd: str | Path,
        env: Mapping[str, str],
        script: bool = False,
        own_session: bool = False,
        output: str | Path | None = None,
    ) -> ChildProcess: ...


def script_of(argv: Sequence[str], python: str) -> tuple[str, list[str]] | None:
    """(script, its arguments) of ``[python, "path/to/script.py", *args]``; None for any other command."""
    if len(argv) >= 2 and argv[0] == python and argv[1].endswith(".py") and not argv[1].startswith("-"):
        return argv[1], list(argv[2:])
    return None


def _default_hub_cache() -> Path:
    """The hub cache huggingface_hub uses when HF_HUB_CACHE is unset (under HF_HOME, else the user's cache)."""
    # here: only an engine forked from a warm Python needs it, and its import costs 0.3 s otherwise unpaid
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _venv_cli(name: str) -> str | None:
    """A console script from this interpreter's environment first (the venv may not be on ``PATH``)."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def vllm_device_args(device: str) -> list[str]:
    """What vLLM needs on a CPU host: eager mode (its torch.compile path wants triton-cpu, absent here) and
    float32 (the checkpoints' own dtype; bf16 kernels need AVX-512); and the model in the engine core's process
    (``uni``, with ``vllm_env.ONE_PROCESS`` in its environment) rather than in a third process of its own. That
    worker process is one more import of vLLM and torch at every start, and its reader of the engine core's
    shared-memory queue spins a core for a second after every call (vLLM 0.32's ``SpinCondition``). Measured on
    SmolLM2 on the 2-core machine, idle: a start 30.0 -> 21.0 s to healthy and 31.7 -> 20.4 CPU-s; 20 chats of
    16 tokens 28.6 -> 14.4 CPU-s at the same wall time, and 0.34 -> 0.02 of a core after them; at 8 requests in
    flight as fast as the worker bound to both cores and 1.4x its default binding (``bench/generation.py``'s
    ``vllm@mp``, docs/measurements.md). Where the worker's binding of threads to cores may pay, a host with many
    cores (not measured here), a lab's ``--distributed-executor-backend mp`` in the engine's extra arguments comes
    later on the command line and wins. A GPU keeps vLLM's defaults."""
    if device.startswith("cuda"):
        return []
    return ["--enforce-eager", "--dtype", "float32", "--distributed-executor-backend", "uni"]


def server_command(
    model_dir: str,
    port: int,
    engine: str,
    device: str = "cpu",
    continuous_batching: bool = False,
    extra_args: Sequence[str] = (),
    served_model_name: str | None = None,
    socket_path: str | Path | None = None,
    model_process: str = "fork",
    model_threads: str | None = None,
) -> list[str]:
    """The command line that serves ``model_dir`` on ``127.0.0.1:port``, or on the Unix socket ``socket_path``
    (no TCP port at all: vLLM's ``--uds``; ``transformers serve`` through ``transformers_engine.py``, which also
    forks its model's process on a CPU, ``model_process``: see that script).

    ``transformers serve`` names the model by the path it was given (``model_dir``); to serve it under a stable
    name, pass that name as ``model_dir`` and run the command where a link of that name points at the model.
    """
    if engine == "vllm":
        where = ["--uds", str(socket_path)] if socket_path else ["--host", "127.0.0.1", "--port", str(port)]
        return [
            *vllm_env.serve_head(model_dir, "cuda" if device.startswith("cuda") else "cpu"),
            *where,
            "--served-model-name",
            served_model_name or Path(model_dir).name,
            *vllm_device_args(device),
            *extra_args,
        ]
    if engine != "transformers":
        raise ValueError(f"unknown serving engine {engine!r}; use 'vllm', 'transformers' or 'auto'")
    if _venv_cli("transformers") is None:  # the serving extra's CLI: what the engine script runs
        raise LLMError("`transformers` CLI not found: install transformers[serving]")
    if model_process not in ("fork", "spawn"):
        raise ValueError(f"model_process is 'fork' or 'spawn', not {model_process!r}")
    head = [sys.executable, str(TRANSFORMERS_ENGINE), "--model-process", model_process]
    # the engine's OMP_NUM_THREADS: the size of a forked model process's torch pool (transformers_engine.py)
    if model_threads:
        head += ["--model-threads", model_threads]
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if socket_path:
        head, where = [*head, "--uds", str(socket_path)], []
    cmd = [
        *head,
        "serve",
        model_dir,
        *where,
        "--device",
        device,
        "--log-level",
        "info",
    ]
    if continuous_batching:
        cmd.append("--continuous-batching")
    return [*cmd, *extra_args]


class ManagedServer:
    """``with ManagedServer(model_dir, log_dir) as server: ... server.base_url ...``

    ``continuous_batching=None`` turns ``transformers serve --continuous-batching`` on only on a GPU. On a CPU it
    depends on the workload: for a one-off smoke request its paged-attention path was measured slower (warm-up),
    while for many concurrent teacher requests on the tiny model it is what makes concurrency pay (without it the
    server answers one request at a time; ~3.5x the sequential throughput at 8 in flight, see
    ``bench/generation.py``). Teacher generation (``LLMResource``) asks for it explicitly.

    Continuous batching reserves its paged KV cache up front, by default 60-90 % of the memory it sees: on a CPU
    host that is system RAM shared with everything else (measured: 14.5 GB for the tiny model, then the OOM killer).
    ``cb_max_memory_percent`` (default 5 % on a CPU, the engine's own default on a GPU) caps it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        log_dir: str | Path,
        engine: str = "auto",
        startup_timeout_s: float = 180.0,
        port: int | None = None,
        device: str = "auto",
        continuous_batching: bool | None = None,
        extra_args: Sequence[str] = (),
        logger: logging.Logger | None = None,
        stop_grace_s: float = 10.0,
        cb_max_memory_percent: float | None = None,
        progress_every_s: float = 10.0,
        served_model_name: str | None = None,
        nice: int = 0,
        extra_env: Mapping[str, str] | None = None,
        own_session: bool = True,
        socket_path: str | Path | None = None,
        warm: WarmInterpreter | None = None,
        model_process: str = "fork",
    ) -> None:
        self.model_dir = str(Path(model_dir).resolve())
        self.socket_path = str(socket_path) if socket_path else None  # no port: HAProxy's, in a 700 folder
        # a lower CPU priority (nice increment, 0..19) from its first instruction on, and environment variables of
        # its own (a thread count, say): an engine loading beside one that serves (serving/service.py)
        self.nice, self.extra_env = nice, dict(extra_env or {})
        # own_session=False: a process group of its own (stopped as one) in the starter's session, so that with
        # autogroups its nice counts against the starter's other children (the engine that serves), not the world
        self.own_session = own_session
        # a warm Python of this process (core/cluster/warm_python.py) the server may fork from (_fork_from_warm)
        self.warm = warm
        # how `transformers serve` starts its model's process: "fork" from the engine where that is safe (a CPU,
        # one thread), else its own "spawn" (transformers_engine.py); "spawn" always, for a comparison
        self.model_process = model_process
        self.served_model_name = served_model_name
        if not (Path(self.model_dir) / "config.json").exists():
            raise LLMError(
                f"cannot serve {self.model_dir}: no config.json (not a Hugging Face model directory)"
            )
        self.engine = choose_engine(self.model_dir, engine)
        if device == "auto":  # vLLM's build follows the host (nvidia-smi); transformers follows its torch
            device = (
                vllm_env.device_kind() if self.engine == "vllm" else "cuda" if cuda_available() else "cpu"
            )
        self.device = device
        self.continuous_batching = self._continuous_batching(continuous_batching)
        self.extra_args = (*self._cb_memory_args(cb_max_memory_percent), *extra_args)
        self._fixed_port = port
        self.port = port or free_port()
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.progress_every_s = progress_every_s  # "not healthy yet" lines while a large model loads
        self.log = logger or log
        self.process: subprocess.Popen[bytes] | ChildProcess | None = None
        self.ready_s: float = 0.0
        self.scratch: Path | None = None  # a vLLM engine's temporary folder while it runs (_vllm_env)

    def _continuous_batching(self, asked: bool | None) -> bool:
        """Whether ``transformers serve`` batches continuously: as ``asked``; ``None``, on a GPU only (the class
        docstring). An error where it is asked of a transformers without it."""
        supported = "continuous_batching" in transformers_serve_options()
        if asked is None:
            asked = self.engine == "transformers" and self.device.startswith("cuda") and supported
        elif asked and not supported and self.engine == "transformers":
            raise LLMError("this transformers version has no `transformers serve --continuous-batching`")
        return bool(asked) and self.engine == "transformers"

    def _cb_memory_args(self, cb_max_memory_percent: float | None) -> tuple[str, ...]:
        """The cap of continuous batching's KV cache (5 % of the memory on a CPU host, see the class docstring)."""
        if cb_max_memory_percent is None and not self.device.startswith("cuda"):
            cb_max_memory_percent = 0.05
        if not self.continuous_batching or cb_max_memory_percent is None:
            return ()
        if not 0 < cb_max_memory_percent <= 1:
            raise ValueError(f"cb_max_memory_percent is a fraction in (0, 1], got {cb_max_memory_percent}")
        if "cb_max_memory_percent" in transformers_serve_options():
            return ("--cb-max-memory-percent", str(cb_max_memory_percent))
        return ()

    def __repr__(self) -> str:
        return (
            f"ManagedServer(engine={self.engine!r}, model_dir={self.model_dir!r}, base_url={self.base_url!r})"
        )

    @property
    def base_url(self) -> str:
        """The OpenAI base URL; on a Unix socket (``socket_path``) the host is a placeholder: send it there."""
        return "http://localhost/v1" if self.socket_path else f"http://127.0.0.1:{self.port}/v1"

    @property
    def log_path(self) -> Path:
        where = Path(self.socket_path).stem if self.socket_path else self.port
        return self.log_dir / f"{self.engine}-serve-{where}.log"

    @property
    def model_name(self) -> str:
        """The name to put in requests: ``served_model_name`` when given; else vLLM serves the directory's name,
        transformers the path itself."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model_dir).name if self.engine == "vllm" else self.model_dir

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> ManagedServer:
        """Start the server and wait until it answers ``/health``; retried on a new port if the port was taken."""
        if self.process is not None:
            raise RuntimeError(f"{self!r} is already running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for attempt in range(attempts):
            try:
                self._spawn()
                self._wait_healthy()
                break
            except LLMError as e:
                self.stop()
                lost_race = any(s in str(e).lower() for s in _PORT_IN_USE)
                if not lost_race or self._fixed_port or attempt == attempts - 1:
                    raise
                self.log.warning(
                    "port %d was taken before the server bound it; retrying on another", self.port
                )
                self.port = free_port()
            except BaseException:  # KeyboardInterrupt, Dagster's interruption: no server left behind
                self.stop()
                raise
        self.ready_s = time.perf_counter() - t0
        self.log.info(
            "%s server for %s healthy at %s after %.1f s (log: %s)",
            self.engine,
            self.model_dir,
            self.base_url,
            self.ready_s,
            self.log_path,
        )
        return self

    def _stable_name_link(self) -> str:
        """``transformers serve`` knows a model by the path it loaded it from: serve it from ``<log_dir>/<name>``,
        a link to the checkpoint, started in ``log_dir``, so that requests name it ``<name>`` whatever the
        checkpoint (the link is replaced only while no engine of this ``log_dir`` runs)."""
        name = self.served_model_name
        assert name is not None
        if "/" in name or name in (".", ".."):
            raise ValueError(
                f"served_model_name {name!r} must be a plain name (it becomes a link in {self.log_dir})"
            )
        link = self.log_dir / name
        tmp = self.log_dir / f".{name}.link"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.model_dir, target_is_directory=True)
        os.replace(tmp, link)
        return name

    def _spawn(self) -> None:
        model = self.model_dir
        if self.served_model_name and self.engine == "transformers":
            model = self._stable_name_link()
        # `transformers serve` scans the hub cache on GET /v1/models and fails when there is none
        cache = Path(settings.HF_HUB_CACHE.get() or self.log_dir / "hf-cache")
        cache.mkdir(parents=True, exist_ok=True)
        # its share of the cores, idle threads asleep between requests
        inherited = settings.child_environ("engine")
        env = {
            **inherited,
            "HF_HUB_OFFLINE": settings.HF_HUB_OFFLINE.get(),
            "HF_HUB_CACHE": str(cache),
            "PYTHONUNBUFFERED": "1",
            "TQDM_DISABLE": "1",
            **self._vllm_env(inherited),
            **self.extra_env,
        }
        cmd = server_command(
            model,
            self.port,
            self.engine,
            self.device,
            self.continuous_batching,
            self.extra_args,
            self.served_model_name,
            self.socket_path,
            self.model_process,
            model_threads=env.get("OMP_NUM_THREADS"),
        )
        if self.socket_path:
            Path(self.socket_path).unlink(missing_ok=True)  # a killed engine's socket: the new one binds anew
        with open(self.log_path, "wb") as logfile:
            logfile.write(f"$ {' '.join(cmd)}\n".encode())
            logfile.flush()
            self.process = self._fork_from_warm(cmd, env) or subprocess.Popen(
                with_parent_death_signal(cmd, self.nice),
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=self.own_session,
                process_group=None if self.own_session else 0,
                cwd=self.log_dir,
            )  # own process group: clean stop
        atexit.register(self.stop)

    def _fork_from_warm(self, cmd: list[str], env: dict[str, str]) -> ChildProcess | None:
        """The server forked from ``warm``, the same process a cold start would be but with torch, transformers
        and its web server imported already (~3 s of a ~9 s start for the tiny model; the model's own process is
        then forked from it, ``transformers_engine.py``); None where it cannot be that same process, said in the
        log: the engine then starts cold.

        Only an engine in a session of its own at the starter's priority (the warm child makes itself a session
        leader that dies with the warm Python, ``WarmPython.spawn``), run as a Python script (``transformers
        serve`` through ``transformers_engine.py``), whose import-time environment is the warm Python's."""
        if self.warm is None:
            return None
        target = script_of(cmd, self.warm.python)
        # the hub cache is read as huggingface_hub loads: unless one is set, the one the warm Python has
        own_cache = bool(settings.HF_HUB_CACHE.get())
        env = env if own_cache else {k: v for k, v in env.items() if k != "HF_HUB_CACHE"}
        why = ""
        if self.nice or not self.own_session:
            why = "it runs at a lower priority or in its starter's session"
        elif target is None:
            why = "its command is not a script run by the warm Python's interpreter"
        elif not self.warm.ready():
            why = "the warm Python did not start"
        elif differs := self.warm.differs(env):
            why = f"its {', '.join(differs[:4])} differ from the warm Python's"
        if why or target is None:
            self.log.info("starting the %s engine cold: %s", self.engine, why)
            return None
        if not own_cache:
            _default_hub_cache().mkdir(parents=True, exist_ok=True)  # scanned on GET /v1/models
        try:
            child = self.warm.spawn(
                *target, self.log_dir, env, script=True, own_session=True, output=self.log_path
            )
        except OSError as e:
            self.log.warning("%s; starting the %s engine cold", e, self.engine)
            return None
        self.log.info("%s engine forked from the warm Python (pid %d)", self.engine, child.pid)
        return child

    def _vllm_env(self, inherited: Mapping[str, str]) -> dict[str, str]:
        """A vLLM engine's variables: a temporary folder of its own, and on a CPU its KV cache's size in GiB (its
        default, 4 GiB, is a sixth of a 24 GiB CI machine).

        The folder (made here, removed by ``stop``) is the engine's ``TMPDIR`` and ``VLLM_RPC_BASE_PATH``: `vllm
        serve` leaves its ZMQ sockets (the front end's and the engine core's, seven with vLLM 0.32) and its
        distributed-init file (``vllm_dist_*``) in the temporary folder even when stopped cleanly, so a serving
        host that starts an engine at every promotion gathered them in ``/tmp`` for good (systemd's
        ``PrivateTmp``, per engine). Torch inductor's cache, which lives in the temporary folder too (compiled
        kernels an engine reuses at its next start, eager engines included), stays where it was: its variable is
        set to the folder torch would have chosen (``inherited`` keeps one a person set). Its precompiled C++
        headers do not follow that variable: torch 2.13 keeps them under the temporary folder's
        ``torchinductor_<user>`` whatever it says, so the engine's folder holds a link of that name to the folder
        torch would have chosen. Without it each engine compiled the same header again, on its first sampled
        request, into a folder ``stop`` removes: 4.5-6.5 CPU-s of ``cc1plus`` and ~6 s of that first answer at
        every start on a CPU host (docs/measurements.md, "vLLM on the CPU machine").
        What else vLLM 0.32 keeps there is not shared by these engines: the locks of its hub downloads (an
        engine here loads a local directory, checked in ``__init__``) and the socket of a weight-cache service
        (not used)."""
        if self.engine != "vllm":
            return {}
        self.scratch = Path(tempfile.mkdtemp(prefix="nexa-vllm-"))  # short: a socket's path has 107 bytes
        shared = Path(default_inductor_cache())
        shared.mkdir(parents=True, exist_ok=True)
        # stop's rmtree unlinks the link and leaves the shared folder
        (self.scratch / shared.name).symlink_to(shared, target_is_directory=True)
        env = {
            "TMPDIR": str(self.scratch),
            "VLLM_RPC_BASE_PATH": str(self.scratch),
            INDUCTOR_CACHE: inherited.get(INDUCTOR_CACHE) or str(shared),
        }
        if not self.device.startswith("cuda"):
            env[settings.VLLM_CPU_KVCACHE_SPACE.name] = settings.VLLM_CPU_KVCACHE_SPACE.get()
            env.update(vllm_env.ONE_PROCESS)  # with vllm_device_args' "uni": why there
        return env

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        deadline, next_note = started + self.startup_timeout_s, started + self.progress_every_s
        root = self.socket_path or f"http://127.0.0.1:{self.port}"
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise LLMError(
                    f"{self.engine} server for {self.model_dir} exited with code "
                    f"{self.process.returncode} before becoming healthy; last log lines "
                    f"({self.log_path}):\n{self.log_tail()}"
                )
            for path in ("/health", "/v1/models"):  # /health first; /v1/models for engines without it
                try:
                    code = http_status(root, path, self.socket_path)
                except OSError:
                    break  # not listening yet (ConnectionError, TimeoutError, no socket file)
                if code == 200:
                    return
                if code != 404:
                    break  # 503 while loading: not ready yet, and the fallback would not be truthful
            if time.monotonic() > deadline:
                raise LLMError(
                    f"{self.engine} server at {root}/health not healthy after "
                    f"{self.startup_timeout_s:.0f} s; last log lines ({self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() >= next_note:  # a vLLM server loading a large model takes minutes: say so
                next_note += self.progress_every_s
                self.log.info(
                    "%s server for %s not healthy yet after %.0f s (gives up at %.0f s); its last log "
                    "line: %s",
                    self.engine,
                    self.model_dir,
                    time.monotonic() - started,
                    self.startup_timeout_s,
                    self.log_tail(1).strip()[-200:],
                )
            time.sleep(0.25)

    def renice(self, nice: int) -> list[str]:
        """Set the server's CPU priority to ``nice`` more than this process's (every thread of it and of its
        children, and its autogroup), as ``nice`` at the start does.

        Returns what could not be set (empty: all of it): lowering a nice value needs ``CAP_SYS_NICE`` (or an
        ``RLIMIT_NICE`` that allows it), while an autogroup's nice may go back to 0 without it.
        """
        if self.process is None:
            return ["the server is not running"]
        level = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        pids = [self.process.pid, *(p.pid for p in _descendants(self.process.pid))]  # type: ignore[attr-defined]
        problems = []
        for pid in pids:
            for tid in _threads(pid):
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, level)
                except ProcessLookupError:
                    continue  # a thread that just ended
                except PermissionError as e:
                    problems.append(f"thread {tid}: {e.strerror}")
        # its autogroup, when it leads a session (one autogroup change per 100 ms, EAGAIN, without CAP_SYS_ADMIN)
        for _ in range(40 if os.getsid(self.process.pid) == self.process.pid else 0):
            try:
                Path(f"/proc/{self.process.pid}/autogroup").write_text(str(level))
                break
            except BlockingIOError:
                time.sleep(0.05)
            except FileNotFoundError:
                break  # no autogroups (another OS, or a kernel without them)
            except OSError as e:
                problems.append(f"autogroup: {e.strerror}")
                break
        if not problems:
            self.nice = nice
        return problems

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after the grace period. Idempotent.

        Descendants are collected before the first signal (when ``psutil`` is present) so that a worker that moved
        to its own session is stopped too.
        """
        proc, self.process = self.process, None
        atexit.unregister(self.stop)
        if proc is None:
            self._remove_scratch()  # a start that failed before its process began
            return
        descendants = _descendants(proc.pid)
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    self.log.warning(
                        "server pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, self.stop_grace_s
                    )
        finally:  # also reached on a second Ctrl-C during the grace period
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # workers that outlived the leader of the group
            for child in descendants:
                with contextlib.suppress(Exception):
                    child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)  # reap: no zombie left in the process table
            _wait_until_exited(descendants, timeout_s=5.0)
            self._remove_scratch()

    def _remove_scratch(self) -> None:
        """The vLLM engine's temporary folder (``_vllm_env``) and what it left there, once it has exited."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def default_inductor_cache() -> str:
    """The folder torch inductor caches in when ``TORCHINDUCTOR_CACHE_DIR`` is unset, as torch 2.13 names it
    (``torch/_inductor/runtime/cache_dir_utils.py``): in this process's temporary folder, per user."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's): torch names it by the number
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (Linux: a nice value belongs to a thread); elsewhere the process alone."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        import psutil  # only when a server is stopped: not at the code location's load
    except ImportError:
        return []
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def _wait_until_exited(processes: Sequence[psutil.Process], timeout_s: float) -> None:
    """Return once every process in ``processes`` has exited, or after ``timeout_s``.

    A SIGKILL is delivered asynchronously, so ``stop`` waits for it to take effect: a caller that looks right after
    ``stop`` finds no worker running. A worker orphaned by the server's death that has exited stays a zombie until
    PID 1 reaps it, which some container inits do only every few seconds (measured: 1-5 s here); it has exited all
    the same, so a zombie counts as exited.
    """
    deadline = time.monotonic() + timeout_s
    for process in processes:
        while time.monotonic() < deadline and process_running(process):
            time.sleep(0.02)


def process_running(process: psutil.Process) -> bool:
    """Whether ``process`` still runs: False once it has exited, also while it waits as a zombie to be reaped."""
    import psutil  # only when a server is stopped: not at the code location's load

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
