"""Workers forked from a warm Python: torch, transformers and DeepSpeed imported once per launcher, not per worker.

Every training and evaluation worker is ``python -m <worker module>`` in a fresh interpreter, and before its first
line of work it imports torch, transformers, the Mixtral modelling code and DeepSpeed: about 6 s on the idle 2-core
machine, more than a tiny model's whole evaluation (``bench/pipeline_profile.py``: ``fixed/worker_startup`` and
most of ``fixed/model_load`` and ``fixed/model_and_deepspeed``). A launcher that starts many workers from one
process (``make run``: fourteen, one after another) starts one *warm* interpreter beside it instead, which imports
those libraries once and then forks a child for each worker; the child runs the same module with the same
arguments, working directory and environment as the cold command would (``runpy``, as ``python -m`` does).

What keeps a forked worker the same as a fresh one:

* **The environment a library read while importing.** libgomp reads ``OMP_WAIT_POLICY`` when it loads,
  huggingface_hub its offline switch, DeepSpeed its accelerator. A worker is forked only when its environment
  equals the warm interpreter's but for the variables read at run time (``RUNTIME_VARIABLES``: the thread counts,
  which the workers apply to torch's pool themselves, ``core/common/threads.use``; the project's own, read when
  asked for, ``settings.py``; Dagster Pipes' per-launch ones). Any other difference (a lab's ``OMP_WAIT_POLICY``
  for training only, say) starts that worker cold, as before, and says which variable.
* **No thread forked mid-work.** The warm interpreter computes nothing and serves in one thread (a ``select``
  loop; children are reaped on ``SIGCHLD``); the only other thread after the imports is jemalloc's background
  thread (pyarrow's allocator), which jemalloc itself re-creates after a fork.
* **Randomness.** torch's default generator is untouched by the imports (a fresh process's fixed seed, as cold);
  Python's and NumPy's global generators are re-seeded from the OS in each child, as a fresh process's are.
* **Signals and exits.** The child takes a fresh interpreter's signal dispositions (``FRESH_SIGNALS``: Python's
  SIGINT handler, SIGPIPE and SIGXFSZ ignored, the rest at their defaults), runs the module as ``__main__``, runs the
  ``atexit`` handlers a normal exit runs, and exits with the module's code; a signal that kills it is reported as
  ``subprocess`` reports one (``-signum``). It stays in the launcher's process group, so a kill of the group (a
  lost node, ``make run`` stopped) takes it with the rest; the warm interpreter itself ends with its launcher.

Only single-process workers are forked (one rank, no ``torchrun``: its agent spawns its ranks itself), and only on
the local backend. ``LocalGPUCluster.warm_start`` turns it on; ``make run`` does (``nexa_dagster/demo.py``).
``fork_worker`` is the question each launch asks (fork, or start cold and say why): the local backend's, and the
benches that train several models through ``WorkerStarter`` (``bench/learning.py``, ``bench/gpu_lifecycle.py --device
cpu``).

A process that keeps one forks the server of a deployment's smoke engine from it as well (``running``;
``ManagedServer(warm=...)``): that child leads a session of its own, which the engine's stop kills as one, writes
to the engine's log, and gets SIGTERM when the warm Python dies (``spawn``'s ``own_session`` and ``output``), as a
cold engine's exec wrapper arranges.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import random
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from nexa_dagster import settings

# what the warm interpreter imports of the libraries: what every worker and a smoke engine import before their first
# line of work. The package's own modules a launcher's workers run are its to add (``LocalGPUCluster``'s
# ``WARM_PRELOAD``): named here, every asset that reaches this module (a deployment's smoke engine) would reach the
# training loop's source and turn stale at each edit of it (``assets/versions.py`` follows module names in strings).
LIBRARIES = (
    "torch",
    "transformers",
    "transformers.models.mixtral.modeling_mixtral",
    # DeepSpeed's ZeRO-1/2 imports it at a rank's first backward to ask whether the optimizer is Muon; its
    # torch.compile decorator imports torch's inductor: 0.8 s idle, several under load, in every training worker
    "deepspeed.runtime.zero.muon.muon_optimizer",
    # a `transformers serve` engine's server (ManagedServer forks a smoke engine from here): its CLI, its web
    # server and the processor classes it loads the model's tokenizer with, ~2.5 s of its ~4.7 s before it spawns
    # the model's process
    "uvicorn",
    "transformers.cli.serve",
    "transformers.processing_utils",
)
# read at run time, not while the preloaded modules import: a child's own value is used as it is (tokenizers reads
# TOKENIZERS_PARALLELISM each time it decides whether to use its thread pool)
RUNTIME_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM")
RUNTIME_PREFIXES = ("NEXA_", "DAGSTER_PIPES_")
START_TIMEOUT_S = 300.0  # the imports: ~6 s idle, a minute or more on a loaded 2-core machine


# the signal dispositions of a fresh interpreter, for those the warm one changes (SIGINT, SIGCHLD) and those it
# must not hand on changed: CPython ignores SIGPIPE (a write to a closed pipe or socket raises BrokenPipeError, not a
# silent death: a forked engine whose health-check client hung up first died of it, 2 of 15 under load) and SIGXFSZ
FRESH_SIGNALS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}


def runtime_variable(name: str) -> bool:
    return name in RUNTIME_VARIABLES or name.startswith(RUNTIME_PREFIXES)


def import_time_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a library may have read while the warm interpreter imported it."""
    return {k: v for k, v in env.items() if not runtime_variable(k)}


def environment_difference(
    warm: Mapping[str, str], wanted: Mapping[str, str], set_by_imports: Mapping[str, str] | None = None
) -> list[str]:
    """The variables, read at import time, whose value a worker wants differently from the warm interpreter's.

    ``set_by_imports``: what the preloaded imports wrote into the environment themselves (DeepSpeed sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` if unset): a worker that lacks one would have its own import set it the
    same way, and one that has it from a launcher that imported the same library has that value."""
    a, b = import_time_environment(warm), import_time_environment(wanted)
    own = dict(set_by_imports or {})
    return sorted(
        k
        for k in a.keys() | b.keys()
        if a.get(k) != b.get(k) and not (k in own and k not in a and b.get(k, own[k]) == own[k])
    )


def module_of(argv: Sequence[str], python: str) -> tuple[str, list[str]] | None:
    """(module, its arguments) of ``[python, "-m", module, *args]``; None for any other command."""
    if len(argv) >= 3 and argv[0] == python and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


class WarmChild:
    """A forked worker, as much of ``subprocess.Popen`` as a launcher uses: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``returncode`` (negative: the signal that killed it)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()
        self.returncode: int | None = None
        reply = self._message(START_TIMEOUT_S)
        if reply is None or "pid" not in reply:
            conn.close()
            why = reply["error"] if reply else "it closed the connection"
            raise OSError(f"the warm interpreter did not fork the worker: {why}")
        self.pid: int = int(reply["pid"])

    def _message(self, timeout: float | None) -> dict | None:
        """The next line from the warm interpreter as JSON; None when it closed the connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(f"warm worker on {self._conn.fileno()}", timeout or 0)
            chunk = self._conn.recv(4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                reply = self._message(timeout)
                # closed without a code: the warm interpreter died (killed with its group); the child with it
                self.returncode = int(reply["returncode"]) if reply else -signal.SIGKILL
                self._conn.close()
            return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class WarmPython:
    """A warm interpreter beside this process: started once (``start``), it forks workers (``spawn``)."""

    python: str
    env: dict[str, str]  # the environment it imported under (thread counts at 1: it computes nothing)
    preload: tuple[str, ...] = LIBRARIES  # modules, or ``module:function`` to import and call
    set_by_imports: dict[str, str] | None = (
        None  # what its imports added to its environment (known once ready)
    )
    process: subprocess.Popen[bytes] | None = None
    socket_path: Path = field(default_factory=Path)
    _dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> WarmPython:
        """Start it importing, without waiting: the first ``spawn`` waits for it to be ready."""
        self._dir = tempfile.TemporaryDirectory(prefix="nexa-warm-")  # 700: only this user reaches the socket
        self.socket_path = Path(self._dir.name) / "warm.sock"
        env = {**self.env, **dict.fromkeys(RUNTIME_VARIABLES, "1")}
        # stdin is how it knows this process is gone (EOF); stdout and stderr are this process's, as a cold
        # worker's would be, and its children inherit them
        self.process = subprocess.Popen(
            [self.python, "-m", __name__, str(self.socket_path), *self.preload],
            stdin=subprocess.PIPE,
            env=env,
        )
        return self

    def ready(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Wait until it has imported everything (its socket appears, listening); False if it died or took too
        long (it is then stopped)."""
        deadline = time.monotonic() + timeout_s
        while self.process is not None and self.process.poll() is None:
            if self.socket_path.exists():
                if self.set_by_imports is None:
                    after = json.loads(self.socket_path.with_suffix(".env.json").read_text())
                    self.set_by_imports = {k: v for k, v in after.items() if k not in self.env}
                return True
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.close()
        return False

    def differs(self, env: Mapping[str, str]) -> list[str]:
        """What in ``env`` a forked worker would not see as a fresh one would (``environment_difference``)."""
        return environment_difference(self.env, env, self.set_by_imports)

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        cwd: str | Path,
        env: Mapping[str, str],
        script: bool = False,
        own_session: bool = False,
        output: str | Path | None = None,
    ) -> WarmChild:
        """Fork ``python -m module args`` (``script``: ``python module args``, a file) in ``cwd`` with ``env``
        (check ``differs`` first).

        ``own_session``: the child leads a session and process group of its own, stopped as one by a kill of its
        group (an engine, ``ManagedServer.stop``), and gets SIGTERM if the warm Python dies (which ends with its
        launcher), as ``managed_server.with_parent_death_signal`` gives a cold one; without it the child is in the
        launcher's group, as a cold worker. ``output``: a file its stdout and stderr are appended to."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.socket_path))
        request = {
            "module": module,
            "script": script,
            "args": list(args),
            "cwd": str(cwd),
            "env": dict(env),
            "own_session": own_session,
            "output": str(output) if output else None,
        }
        conn.sendall(json.dumps(request).encode() + b"\n")
        return WarmChild(conn)

    def close(self) -> None:
        if self.process is not None:
            with contextlib.suppress(OSError, ValueError):
                if self.process.stdin is not None:
                    self.process.stdin.close()  # EOF: it exits
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


class _Log(Protocol):
    def info(self, msg: str) -> None: ...

    def warning(self, msg: str) -> None: ...


def fork_worker(
    pool: WarmPython,
    command: Sequence[str],
    cwd: str | Path,
    env: Mapping[str, str],
    log: _Log,
    own_session: bool = False,
    output: str | Path | None = None,
) -> WarmChild | None:
    """``command`` (``python -m module ...`` of ``pool``'s interpreter) forked from ``pool`` where the child would be
    the process a cold start is; None where it would not, said in ``log``: the caller then starts it cold. What a
    launcher of workers asks before each launch (``LocalGPUCluster``, the benches that train)."""
    target = module_of(command, pool.python)
    if target is None:
        log.info(f"starting {' '.join(command[:3])} cold: not `python -m` of the warm Python's interpreter")
    elif not pool.ready():
        log.warning("the warm Python did not start; starting the worker cold")
    elif differs := pool.differs(env):
        log.info(f"starting the worker cold: its {', '.join(differs[:4])} differ from the warm Python's")
    else:
        try:
            child = pool.spawn(*target, cwd, env, own_session=own_session, output=output)
        except OSError as e:
            log.warning(f"{e}; starting the worker cold")
            return None
        log.info(f"worker forked from the warm Python (pid {child.pid})")
        return child
    return None


@dataclass
class WorkerStarter:
    """What a script that starts several workers itself keeps (the benches that train several models, as `make
    run` keeps its warm Python): a warm Python started beside it, each worker forked from it where ``fork_worker``
    allows, else a fresh process, with its output in a file of its own either way. ``env``: the environment the
    workers will get; what of it a library reads while importing is what the warm Python imports under."""

    python: str
    env: Mapping[str, str]
    log: _Log
    preload: tuple[str, ...] = LIBRARIES
    pool: WarmPython | None = None

    def start(self) -> WorkerStarter:
        """Start the warm Python importing, without waiting: the first launch waits for it."""
        self.pool = WarmPython(self.python, import_time_environment(self.env), self.preload).start()
        return self

    def launch(
        self,
        command: Sequence[str],
        cwd: str | Path,
        output: Path,
        env: Mapping[str, str] | None = None,
        own_session: bool = False,
        fork: bool = True,
    ) -> WarmChild | subprocess.Popen[bytes]:
        """``command`` started with its stdout and stderr in a fresh ``output``, under ``env`` (default: the
        starter's), in a session of its own if ``own_session``: forked where it can be the process a cold start is,
        else started cold (``fork``: False starts it cold whatever, for a command the caller knows a fork would
        change). Either answers ``pid``, ``poll``, ``wait`` and ``send_signal``."""
        env = self.env if env is None else env
        output.write_bytes(b"")
        if fork and self.pool is not None:
            child = fork_worker(
                self.pool, command, cwd, env, self.log, own_session=own_session, output=output
            )
            if child is not None:
                return child
        with open(output, "ab") as out:
            return subprocess.Popen(
                list(command),
                cwd=str(cwd),
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=own_session,
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


_shared: dict[str, WarmPython] = {}
_shared_lock = threading.Lock()


def shared(python: str, env: Mapping[str, str], preload: Sequence[str] = LIBRARIES) -> WarmPython:
    """This process's warm interpreter for ``python``, started on first use under ``env`` importing ``preload``
    (then kept until this process exits: the next worker forks from it)."""
    with _shared_lock:
        warm = _shared.get(python)
        if warm is None or warm.process is None:
            warm = _shared[python] = WarmPython(python, import_time_environment(env), tuple(preload)).start()
            atexit.register(warm.close)
        return warm


def running(python: str) -> WarmPython | None:
    """This process's warm interpreter for ``python`` if one was started (``shared``), else None: what else this
    process starts (a smoke test's engine) may fork from it too, without starting one of its own."""
    with _shared_lock:
        warm = _shared.get(python)
        return warm if warm is not None and warm.process is not None else None


# --- the warm interpreter ------------------------------------------------------------------------------------


def _own_session(warm_pid: int) -> None:
    """In a forked child: a session of its own, and SIGTERM when the warm Python (its parent) dies."""
    os.setsid()
    with contextlib.suppress(Exception):  # not Linux: no parent-death signal, as with_parent_death_signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != warm_pid:
        os._exit(143)  # the warm Python died before prctl took effect


def _redirect_output(path: str) -> None:
    """Stdout and stderr appended to ``path`` (the streams keep their buffering: the warm Python's, which the
    import-time environment check made the child's own, PYTHONUNBUFFERED included)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _run_child(
    request: dict, closing: list[socket.socket | selectors.BaseSelector | int], warm_pid: int
) -> None:
    """In the forked child: become the worker the request describes, then exit with its code (never returns)."""
    code, killed_by = 1, 0
    try:
        signal.set_wakeup_fd(-1)
        for sig, disposition in FRESH_SIGNALS.items():
            signal.signal(sig, disposition)
        if request.get("own_session"):
            _own_session(warm_pid)
        for item in closing:
            with contextlib.suppress(OSError):
                os.close(item) if isinstance(item, int) else item.close()
        null = os.open(os.devnull, os.O_RDONLY)  # not the launcher's pipe: a cold worker reads nothing either
        os.dup2(null, 0)
        os.close(null)
        if request.get("output"):
            _redirect_output(request["output"])
        os.chdir(request["cwd"])
        settings.replace_environ(request["env"])
        random.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        sys.argv = [request["module"], *request["args"]]
        try:
            if request.get("script"):  # as `python script.py`: spawned children re-run it by its path
                runpy.run_path(request["module"], run_name="__main__")
            else:
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException as e:  # what a fresh interpreter prints before it exits
            import traceback  # here: only on the way out of a failed child

            traceback.print_exc()
            code = 1
            if isinstance(e, KeyboardInterrupt):  # a fresh one then dies of SIGINT, and its parent sees -2
                killed_by = signal.SIGINT
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if killed_by:
            signal.signal(killed_by, signal.SIG_DFL)
            os.kill(os.getpid(), killed_by)
        os._exit(code)


def serve(socket_path: str, preload: Sequence[str]) -> None:
    """Import ``preload``, listen on ``socket_path``, then fork a worker per connection until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the launcher's group is for the workers
    for name in preload:
        module, _, function = name.partition(":")
        try:
            imported = importlib.import_module(module)
        except ImportError as e:  # a library that moved a module: the workers import it themselves, as cold
            print(f"warm Python: not preloading {name}: {e}", file=sys.stderr, flush=True)
            continue
        if function:
            getattr(imported, function)()
    after = import_time_environment(
        settings.whole_environ()
    )  # with what the imports set themselves (WarmPython.ready)
    Path(socket_path).with_suffix(".env.json").write_text(
        json.dumps(after)
    )  # before the socket: ready() reads it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".binding")
    listener.listen(8)
    # at its path only once it listens: the launcher's sign that the imports are done
    os.rename(socket_path + ".binding", socket_path)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    selector.register(wake_read, selectors.EVENT_READ, "signal")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the launcher is gone; its workers watch it themselves (core/common/workers.py)
            elif key.data == "signal":
                os.read(wake_read, 4096)
                _reap(children)
            else:
                conn, _ = listener.accept()
                _fork(conn, children, [listener, selector, wake_read, wake_write])


def _fork(conn: socket.socket, children: dict[int, socket.socket], closing: list) -> None:
    try:
        with conn.makefile("rb") as lines:
            request = json.loads(lines.readline())
        warm_pid = os.getpid()
        pid = os.fork()
    except Exception as e:  # a bad request or no fork: the launcher starts that worker cold
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": repr(e)}).encode() + b"\n")
            conn.close()
        return
    if pid == 0:
        _run_child(request, [*closing, conn, *children.values()], warm_pid)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
