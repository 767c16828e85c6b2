"""Workers forked from a warm Python (core/cluster/warm_python.py) against fresh interpreters: real processes,
real signals. What a launcher relies on: the module runs as ``python -m`` would run it (arguments, working
directory, environment, exit code, a signal's code), with the preloaded libraries already imported; a worker whose
import-time environment differs is started cold; the warm Python ends with its launcher."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psutil
import pytest

from nexa_dagster.core.cluster import warm_python
from nexa_dagster.resources.gpu_cluster.local import LocalGPUCluster

PROBE = textwrap.dedent(
    """
    import json, os, random, signal, sys, time
    out = {"cwd": os.getcwd(), "argv": sys.argv[1:], "probe": os.environ.get("PROBE"), "name": __name__,
           "torch_loaded_before_me": "torch" in sys.modules, "random": random.random(), "pid": os.getpid(),
           "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                       if s not in (signal.SIGKILL, signal.SIGSTOP)}}
    print(json.dumps(out), flush=True)
    if sys.argv[1:2] == ["sleep"]:
        open(f"sleeping.{os.getpid()}", "w").close()  # the test signals it only from here on
        time.sleep(120)
    sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
    """
)


@pytest.fixture(scope="module")
def probe_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose PYTHONPATH holds ``probe.py`` (PYTHONPATH is read when an interpreter starts: the
    warm Python must have been started with it)."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.py").write_text(PROBE)
    (folder / "hooked.py").write_text("import os\ndef mark():\n    os.environ['HOOKED_BY_PRELOAD'] = '1'\n")
    (folder / "draw.py").write_text(
        "import random, sys, numpy\n"
        "open(sys.argv[1], 'w').write(repr((random.random(), numpy.random.random())))\n"
    )
    return {**os.environ, "PYTHONPATH": str(folder)}


@pytest.fixture(scope="module")
def warm(probe_env: dict[str, str]) -> Iterator[warm_python.WarmPython]:
    # numpy.random too (numpy imports it lazily): its global generator must be re-seeded in each child
    started = warm_python.WarmPython(
        sys.executable, warm_python.import_time_environment(probe_env), ("torch", "numpy.random")
    )
    started.start()
    assert started.ready(), "the warm Python did not start"
    yield started
    started.close()


def test_a_forked_worker_runs_the_module_as_python_dash_m_with_torch_already_imported(
    warm: warm_python.WarmPython, probe_env: dict[str, str], tmp_path: Path
) -> None:
    cold = subprocess.run(
        [sys.executable, "-m", "probe", "3", "x"],
        cwd=tmp_path,
        env={**probe_env, "PROBE": "p"},
        capture_output=True,
        text=True,
    )
    forked = subprocess.run(  # through a launcher process, so its stdout (the child's) can be read
        [
            sys.executable,
            "-c",
            "import sys, os; from nexa_dagster.core.cluster import warm_python as w;"
            "h = w.WarmPython(sys.executable, w.import_time_environment(os.environ), ('torch',)).start();"
            "assert h.ready(); c = h.spawn('probe', ['3', 'x'], sys.argv[1], {**os.environ, 'PROBE': 'p'});"
            "code = c.wait(); h.close(); sys.exit(code)",
            str(tmp_path),
        ],
        env=probe_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    a, b = json.loads(cold.stdout), json.loads(forked.stdout)
    assert cold.returncode == forked.returncode == 3, forked.stderr[-2000:]
    # the signals too: a forked worker handed SIGPIPE at its default (not ignored, as CPython starts) dies silently
    # of a write to a closed pipe or socket (a forked engine did, under load)
    for key in ("cwd", "argv", "probe", "name", "signals"):
        assert a[key] == b[key], (key, a, b)
    assert b["argv"] == ["3", "x"] and b["name"] == "__main__" and b["cwd"] == str(tmp_path)
    assert not a["torch_loaded_before_me"] and b["torch_loaded_before_me"]  # the point: imported once, before


def test_exit_codes_and_signals_read_as_a_fresh_process_s(
    warm: warm_python.WarmPython, probe_env: dict[str, str], tmp_path: Path
) -> None:
    assert warm.spawn("probe", ["0"], tmp_path, probe_env).wait(timeout=60) == 0
    assert warm.spawn("probe", ["75"], tmp_path, probe_env).wait(timeout=60) == 75
    missing = warm.spawn("no_such_module_here", [], tmp_path, probe_env)
    assert missing.wait(timeout=60) == 1  # as `python -m no_such_module_here`
    for sig in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM):
        cold = subprocess.Popen([sys.executable, "-m", "probe", "sleep"], cwd=tmp_path, env=probe_env)
        forked = warm.spawn("probe", ["sleep"], tmp_path, probe_env)
        # both inside the sleep (a cold start under the suite's load took over 1.5 s: an import interrupted by a
        # signal says so in its own way)
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"sleeping.{p.pid}").exists() for p in (cold, forked)):
            assert cold.poll() is None and forked.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        cold.send_signal(sig)
        forked.send_signal(sig)
        assert forked.wait(timeout=30) == cold.wait(timeout=30) == -sig, sig


def test_two_workers_do_not_share_the_warm_python_s_random_state(
    warm: warm_python.WarmPython, probe_env: dict[str, str], tmp_path: Path
) -> None:
    """Python's and NumPy's generators are re-seeded in each child, as each fresh interpreter seeds its own: two
    forked workers draw differently (a fork alone would hand both the warm Python's state)."""
    draws = []
    for i in range(2):
        out = tmp_path / f"{i}.txt"
        assert warm.spawn("draw", [str(out)], tmp_path, probe_env).wait(timeout=60) == 0
        draws.append(out.read_text())
    (random_a, numpy_a), (random_b, numpy_b) = (ast.literal_eval(d) for d in draws)
    assert random_a != random_b and numpy_a != numpy_b, draws


def test_a_worker_whose_import_time_environment_differs_starts_cold(
    warm: warm_python.WarmPython, probe_env: dict[str, str]
) -> None:
    base = warm.env
    runtime = {**base, "OMP_NUM_THREADS": "7", "NEXA_LAUNCHER_PID": "1", "DAGSTER_PIPES_CONTEXT": "x"}
    assert warm_python.environment_difference(base, runtime) == []
    policy = {**base, "OMP_WAIT_POLICY": "ACTIVE"}
    assert warm_python.environment_difference(base, policy) == ["OMP_WAIT_POLICY"]
    moved = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    assert warm_python.environment_difference(base, moved) == ["PYTHONPATH"]
    # what an import sets itself (DeepSpeed: PYTORCH_NVML_BASED_CUDA_CHECK=1 if unset) is no difference, whether
    # the worker's launcher imported it already or not; another value is one
    nvml = "PYTORCH_NVML_BASED_CUDA_CHECK"
    base = {k: v for k, v in base.items() if k != nvml}
    for wanted, differs in (({nvml: "1"}, []), ({}, []), ({nvml: "0"}, [nvml])):
        assert warm_python.environment_difference(base, {**base, **wanted}, {nvml: "1"}) == differs


class _Said:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, msg: str) -> None:
        self.lines.append(("info", msg))

    def warning(self, msg: str) -> None:
        self.lines.append(("warning", msg))


def test_fork_worker_forks_what_a_cold_start_would_be_and_says_why_it_does_not(
    warm: warm_python.WarmPython, probe_env: dict[str, str], tmp_path: Path
) -> None:
    """What every launcher of workers asks before a launch (the local backend, the benches that train): forked,
    the worker's output goes to ``output``; another import-time environment or a command that is not ``python -m``
    is left to a cold start (None), with the reason in the log."""
    said, log = _Said(), tmp_path / "worker.log"
    command = [sys.executable, "-m", "probe", "5"]
    child = warm_python.fork_worker(warm, command, tmp_path, dict(probe_env), said, output=log)
    assert isinstance(child, warm_python.WarmChild) and child.wait(timeout=120) == 5
    assert json.loads(log.read_text())["torch_loaded_before_me"] is True
    assert said.lines == [("info", f"worker forked from the warm Python (pid {child.pid})")]
    said.lines.clear()
    policy = {**probe_env, "OMP_WAIT_POLICY": "ACTIVE"}
    assert warm_python.fork_worker(warm, command, tmp_path, policy, said) is None
    assert said.lines == [
        ("info", "starting the worker cold: its OMP_WAIT_POLICY differ from the warm Python's")
    ]
    said.lines.clear()
    assert warm_python.fork_worker(warm, ["/bin/true"], tmp_path, dict(probe_env), said) is None
    assert "not `python -m`" in said.lines[0][1]


def test_a_worker_starter_forks_where_it_can_and_starts_cold_where_asked_with_output_in_a_fresh_file(
    warm: warm_python.WarmPython, probe_env: dict[str, str], tmp_path: Path
) -> None:
    """What the benches that train several models start their workers with: forked from the warm Python where
    ``fork_worker`` allows, cold where the caller says a fork would change the command (``fork=False``) or no warm
    Python was started; the output in a file emptied first either way; ``own_session`` a session of its own."""
    said, log = _Said(), tmp_path / "worker.log"
    log.write_text("a previous run's output\n")
    starter = warm_python.WorkerStarter(sys.executable, probe_env, said, pool=warm)
    command = [sys.executable, "-m", "probe", "3"]
    forked = starter.launch(command, tmp_path, log, own_session=True)  # the starter's environment
    assert isinstance(forked, warm_python.WarmChild) and forked.wait(timeout=120) == 3
    out = json.loads(log.read_text())  # one line: the previous run's output is gone
    assert out["torch_loaded_before_me"] is True and out["cwd"] == str(tmp_path)
    probe = [sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"]
    for fork in (True, False):  # a session of its own, forked or cold
        cold = starter.launch(probe, tmp_path, log, probe_env, own_session=True, fork=fork)
        assert cold.wait(timeout=120) == 0 and log.read_text().strip() == "True"
    cold = starter.launch(command, tmp_path, log, probe_env, fork=False)
    assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=120) == 3
    assert json.loads(log.read_text())["torch_loaded_before_me"] is False
    unstarted = warm_python.WorkerStarter(sys.executable, probe_env, said)
    cold = unstarted.launch(command, tmp_path, log)
    assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=120) == 3


def test_a_preload_entry_module_colon_function_imports_the_module_and_calls_the_function(
    probe_env: dict[str, str],
) -> None:
    """``module:function`` in the preload: how a launcher runs a set-up step in the warm Python (the local backend
    imports DeepSpeed through the training loop's ``import_deepspeed``); what the call set is what the warm Python's
    imports set, which a forked worker's environment is checked against."""
    env = warm_python.import_time_environment(probe_env)
    for preload, hooked in ((("hooked:mark",), {"HOOKED_BY_PRELOAD": "1"}), (("hooked",), {})):
        warm = warm_python.WarmPython(sys.executable, env, preload).start()
        try:
            assert warm.ready(), preload
            assert {
                k: v for k, v in (warm.set_by_imports or {}).items() if k == "HOOKED_BY_PRELOAD"
            } == hooked
        finally:
            warm.close()


@pytest.mark.slow  # the full preload (torch, transformers, DeepSpeed): make test; make test-fast keeps the rest
def test_the_local_backend_forks_a_worker_only_where_its_environment_allows(
    probe_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LocalGPUCluster(warm_start=True)`` hands a ``python -m`` worker to the warm Python, and starts one
    that wants another wait policy (or runs under torchrun) as a fresh process; off, every worker is fresh."""
    for key, value in probe_env.items():
        monkeypatch.setenv(key, value)
    context = dg.build_asset_context()
    cluster = LocalGPUCluster(warm_start=True)
    command = [sys.executable, "-m", "probe", "0"]
    try:
        forked = cluster._start(context, command, tmp_path, dict(probe_env))
        assert isinstance(forked, warm_python.WarmChild) and forked.wait(timeout=120) == 0
        other = cluster._start(context, command, tmp_path, {**probe_env, "OMP_WAIT_POLICY": "ACTIVE"})
        assert isinstance(other, subprocess.Popen) and other.wait(timeout=120) == 0
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--help"]
        assert warm_python.module_of(torchrun, sys.executable) == ("torch.distributed.run", ["--help"])
        assert warm_python.module_of(["/bin/true"], sys.executable) is None
    finally:
        warm_python.shared(sys.executable, probe_env).close()
    off = LocalGPUCluster()._start(context, command, tmp_path, dict(probe_env))
    assert isinstance(off, subprocess.Popen) and off.wait(timeout=120) == 0


def test_the_warm_python_ends_with_its_launcher(probe_env: dict[str, str]) -> None:
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, os, time; from nexa_dagster.core.cluster import warm_python as w;"
            "h = w.WarmPython(sys.executable, w.import_time_environment(os.environ), ('json',)).start();"
            "assert h.ready(); print(h.process.pid, flush=True); time.sleep(300)",
        ],
        env=probe_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    warm_pid = int(launcher.stdout.readline())
    assert psutil.pid_exists(warm_pid)
    launcher.kill()  # no atexit, no close: the warm Python must notice on its own
    launcher.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(warm_pid) and psutil.Process(warm_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the warm Python outlived its launcher"
        time.sleep(0.1)


# a script (run as `python engine.py`, as ManagedServer runs `transformers serve` on a Unix socket): what it is
ENGINE_PROBE = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    pdeathsig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig))  # PR_GET_PDEATHSIG
    print(json.dumps({"leads_its_session": os.getsid(0) == os.getpid(), "pdeathsig": pdeathsig.value,
                      "name": __name__, "argv": sys.argv}), flush=True)
    if sys.argv[1:] == ["sleep"]:
        time.sleep(120)
    """
)


def test_an_engine_forked_in_a_session_of_its_own_writes_its_log_and_dies_with_the_warm_python(
    probe_env: dict[str, str], tmp_path: Path
) -> None:
    """What ``ManagedServer`` relies on when it forks an engine (``own_session``, ``output``, ``script``): the
    engine leads a session of its own (its stop kills that group, nothing of the launcher's), its output is in its
    log file, it runs as ``python engine.py`` would, and when the warm Python is killed it gets SIGTERM, as a cold
    engine's exec wrapper arranges: no engine outlives what started it. A worker (no ``own_session``) is in the
    launcher's group, without that signal: the contrast the test would lose if the options did nothing."""
    warm = warm_python.WarmPython(sys.executable, warm_python.import_time_environment(probe_env), ("json",))
    assert warm.start().ready()
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_PROBE)
    try:
        worker_log = tmp_path / "worker.log"
        worker = warm.spawn(str(script), ["once"], tmp_path, probe_env, script=True, output=worker_log)
        assert worker.wait(timeout=60) == 0
        assert json.loads(worker_log.read_text()) == {
            "leads_its_session": False,
            "pdeathsig": 0,
            "name": "__main__",
            "argv": [str(script), "once"],
        }
        log = tmp_path / "engine.log"
        log.write_text("$ the command line\n")  # ManagedServer's first line: the engine's output follows it
        engine = warm.spawn(
            str(script), ["sleep"], tmp_path, probe_env, script=True, own_session=True, output=log
        )
        deadline = time.monotonic() + 60
        while len(log.read_text().splitlines()) < 2:
            assert engine.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        first, facts = log.read_text().splitlines()[:2]
        assert first == "$ the command line"
        assert json.loads(facts) == {
            "leads_its_session": True,
            "pdeathsig": signal.SIGTERM,
            "name": "__main__",
            "argv": [str(script), "sleep"],
        }
        assert os.getpgid(engine.pid) == engine.pid != os.getpgid(0)
        assert warm.process is not None
        os.kill(warm.process.pid, signal.SIGKILL)  # no close, no EOF: the warm Python is simply gone
        deadline = time.monotonic() + 30
        while psutil.pid_exists(engine.pid) and psutil.Process(engine.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the engine outlived the warm Python"
            time.sleep(0.1)
    finally:
        warm.close()
