"""Installing Python packages into a virtual environment: with uv where it can, with pip where it cannot.

Why uv: a newcomer's first ``make run`` starts with the install (issue 49: "say what the install spends and cut what
is ours to cut"), and the suite's vLLM environment installs beside the tests, taking CPU from them. pip resolves and
unpacks in Python, one wheel at a time; uv (a Rust binary, on PyPI) does the same work in parallel. On the idle
2-core AMD EPYC, every cache empty, two runs of each side in turns: ``make install`` 145 and 162 s with pip against
45 and 48 s with uv (the same packages at the same versions, the same bytecode), the dev extra 22-24 s against 4 s,
the vLLM environment 116-138 s against 64-88 s (docs/measurements.md, "What the install spends").

Why pip's configuration: where packages come from (an index, a mirror, a folder of wheels on disk, a constraints
file) is set in pip's configuration on this machine and in a lab's, and uv reads none of it. So
``uv_options`` translates what ``pip config list`` says into uv's options, and an option it cannot translate (one
that would change *what* is installed, such as ``only-binary``) makes the install pip's, saying which. uv picks
the best version across every index, as pip does (``--index-strategy unsafe-best-match``; uv's own default is the
first index that has the package), but takes that version's files from the first index that has it where pip pools
them: on this machine one package of 212 (``multiprocess``) gets its ``py310`` wheel, not pip's ``py311``.

pip stays the fallback: where uv is not installed (a venv made without ``make``), where its install failed (the
platform has no uv wheel), and where uv's install fails (it prints why), pip installs the same requirements.

Why a lock (``constraints.txt``, ``make lock``): pyproject.toml states the ranges the code supports, so any release
of any of ~210 dependencies changed what a clean clone installed, between a suite run here and the same commit's CI
an hour later (pyarrow 26.0.1 did: it writes its own version into every Parquet file). ``make install`` installs the
versions the lock names (``-c``, for uv and pip alike); ``lock_pins`` turns a fresh, unconstrained install's
``pip freeze`` into that file, so a new release enters only when someone runs ``make lock`` and the suite on it.

Standard library only (and ``settings``): the Makefile runs it with the new environment's Python before anything,
this package included, is installed there.
"""

from __future__ import annotations

import argparse
import ast
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nexa_dagster import settings

# the uv the project installs with: pinned, so that every machine resolves and installs the same way
UV_REQUIREMENT = "uv==0.13.10"
# the lock's first lines: what it is and how it is made
LOCK_HEADER = """The versions `make install` and `make install-dev` install (`-c constraints.txt`, uv and pip alike):
what a fresh, unconstrained install of torch==2.13.0 and nexa-dagster[dev,k8s] resolved (`make lock` resolves it
again from nothing: then `make test` on it, and commit both). pyproject.toml keeps the ranges the code supports;
this file keeps a clean clone's install the same from one day to the next (core/common/installer.py says why)."""
LOCK_WIDTH = 110  # a lock's comment lines, as the project's code (pyproject.toml's ruff line-length)
# installed by the installer itself, not by a requirement of the project: never in the lock
_NOT_LOCKED = {"pip", "setuptools", "wheel", "uv"}

# pip's options that say where packages come from, as uv spells them: one value, or a whitespace-separated list
_SINGLE = {"index-url": "--index-url"}
_LISTS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
_FLAGS = {"no-index": "--no-index", "pre": "--prerelease=allow"}
# pip's options that uv takes from the environment (how to connect, not what to install)
_ENVIRONMENT = {
    "cert": ("SSL_CERT_FILE",),
    "client-cert": ("SSL_CLIENT_CERT",),
    "timeout": ("UV_HTTP_TIMEOUT",),
    "default-timeout": ("UV_HTTP_TIMEOUT",),
    "proxy": ("HTTP_PROXY", "HTTPS_PROXY"),
}
# pip's options that change nothing uv installs: its own output, cache, prompts and version check
_NO_EFFECT = {
    "disable-pip-version-check",
    "quiet",
    "verbose",
    "progress-bar",
    "no-color",
    "no-cache-dir",
    "cache-dir",
    "root-user-action",
    "no-input",
    "yes",
    "no-warn-script-location",
    "no-warn-conflicts",
    "retries",
    "log",
}
# a later source of pip's configuration overrides an earlier one: the [global] section, the [install] section,
# then the PIP_* variables (``pip config list`` names them ``:env:``)
_SECTIONS = ("global", "install", ":env:")


class Untranslatable(ValueError):
    """An option of pip's configuration that uv has no equivalent for: the install is pip's."""


@dataclass(frozen=True)
class UvOptions:
    """uv's arguments and environment variables for what pip's configuration says."""

    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def pip_options(listing: str) -> dict[str, str]:
    """The options in effect for ``pip install`` from the text of ``pip config list`` (lines such as
    ``global.find-links='/opt/wheels'``): per option, the variable over the ``[install]`` section over
    ``[global]``. Sections of other commands (``[freeze]``, ``[download]``) do not apply."""
    found: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        key, sep, quoted = line.partition("=")
        section, dot, option = key.rpartition(".")
        if not sep or not dot or section not in _SECTIONS:
            continue
        found.setdefault(option, {})[section] = _unquoted(quoted)
    return {
        option: next(by_section[s] for s in reversed(_SECTIONS) if s in by_section)
        for option, by_section in found.items()
    }


def _unquoted(quoted: str) -> str:
    """A value as ``pip config list`` prints it (``repr()``), or as it stands if it is not a literal."""
    try:
        return str(ast.literal_eval(quoted))
    except (ValueError, SyntaxError):
        return quoted


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def uv_options(options: dict[str, str]) -> UvOptions:
    """uv's equivalent of pip's ``options`` (``pip_options``); ``Untranslatable`` names an option it has none for."""
    args: list[str] = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    for option, value in sorted(options.items()):
        if option in _SINGLE:
            args += [_SINGLE[option], value]
        elif option in _LISTS:
            for item in value.split():
                args += [_LISTS[option], item]
        elif option in _FLAGS:
            args += [_FLAGS[option]] if _true(value) else []
        elif option in _ENVIRONMENT:
            env.update(dict.fromkeys(_ENVIRONMENT[option], value))
        elif option not in _NO_EFFECT:
            raise Untranslatable(f"pip's option {option}={value!r} has no uv equivalent here")
    return UvOptions(tuple(args), env)


def uv_binary() -> Path | None:
    """The project's uv (``UV_REQUIREMENT``, beside this interpreter), or None where it is not installed."""
    uv = Path(sys.executable).parent / "uv"
    return uv if uv.exists() else None


def bootstrap(log: Callable[[str], None] = print) -> Path | None:
    """Install ``UV_REQUIREMENT`` beside this interpreter with pip (a few seconds), unless it is there; None (and
    pip's error, logged) where pip cannot: ``install`` then goes on with pip and says so, once."""
    if uv_binary() is None:
        done = _run([sys.executable, "-m", "pip", "install", "-q", UV_REQUIREMENT], settings.PIP)
        if done.returncode != 0:
            # install() then says that pip installs, once
            log(f"{UV_REQUIREMENT} could not be installed: {done.stderr.strip()[-300:]}")
    return uv_binary()


def install(
    python: Path,
    requirements: Sequence[str],
    compile_bytecode: bool,
    log: Callable[[str], None] = print,
    uv: Path | None = None,
) -> str:
    """Install ``requirements`` (pip's syntax: ``-e .``, ``-c FILE`` and requirement strings) into the environment
    of ``python``, byte-compiled or not; returns which installer did it, ``"uv"`` or ``"pip"``. A failed pip install
    raises ``CalledProcessError``."""
    uv = uv or uv_binary()
    reason = "uv is not installed beside this Python" if uv is None else ""
    if uv is not None:
        try:
            options = uv_options(pip_options(pip_config(python)))
        except Untranslatable as error:
            reason = str(error)
        else:
            done = _uv_install(uv, python, requirements, compile_bytecode, options)
            if done.returncode == 0:
                return "uv"
            reason = f"uv failed (exit {done.returncode}): {done.stderr.strip()[-600:]}"
    log(f"installing {' '.join(requirements)} with pip: {reason}")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    cmd = [*pip, *([] if compile_bytecode else ["--no-compile"]), *requirements]
    subprocess.run(cmd, check=True, env=settings.environ(settings.PIP))
    return "pip"


def pip_config(python: Path) -> str:
    """``pip config list`` as the environment's own pip reads it (its ``pip.conf`` included); empty if it has none."""
    done = _run([str(python), "-m", "pip", "config", "list"], settings.PIP)
    return done.stdout if done.returncode == 0 else ""


def _uv_install(
    uv: Path, python: Path, requirements: Sequence[str], compile_bytecode: bool, options: UvOptions
) -> subprocess.CompletedProcess[str]:
    target = [str(uv), "pip", "install", "-q", "--python", str(python), *options.args]
    cmd = [*target, *(["--compile-bytecode"] if compile_bytecode else []), *requirements]
    return _run(cmd, settings.PIP + settings.UV, options.env)


def _run(
    cmd: list[str], prefixes: tuple[str, ...], extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**settings.environ(prefixes), **(extra or {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


def freeze(python: Path, *options: str) -> str:
    """``pip freeze`` of the environment of ``python`` (with pip's variables, as every pip call here)."""
    return subprocess.run(
        [str(python), "-m", "pip", "freeze", *options],
        env=settings.environ(settings.PIP),
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def lock_pins(frozen: str) -> list[str]:
    """The lock's lines from ``pip freeze --exclude-editable``: one ``name==version`` per package, sorted by name,
    less what the installer installs itself, less local version labels (``torch==2.13.0+cpu`` pins ``2.13.0``, which
    the CPU index and PyPI both serve). A package installed from a URL or a path cannot be a constraint another
    machine can meet: ``ValueError`` names it."""
    pins: dict[str, str] = {}
    for line in frozen.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or " @ " in line:
            raise ValueError(
                f"pip freeze line {line!r} is not name==version: not a pin another machine can meet"
            )
        if name.lower() not in _NOT_LOCKED:
            pins[name] = f"{name}=={version.split('+')[0]}"
    return [pins[name] for name in sorted(pins, key=str.lower)]


def write_lock(python: Path, path: Path, header: str) -> int:
    """``path`` from what the environment of ``python`` has installed (``lock_pins``) under ``header`` and the
    day, Python and machine it was resolved on, written beside it and renamed (a failed freeze leaves the old lock);
    returns how many packages it pins."""
    pins = lock_pins(freeze(python, "--exclude-editable"))
    resolved = (
        f"Resolved {time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, {platform.machine()}."
    )
    partial = path.with_name(path.name + ".partial")
    partial.write_text(lock_comment(header) + f"# {resolved}\n" + "\n".join(pins) + "\n")
    partial.replace(path)
    return len(pins)


def lock_comment(header: str) -> str:
    """``header`` as a lock's comment: one paragraph, refilled into lines of ``LOCK_WIDTH`` characters at most
    whatever the requirements filled into it (a vLLM lock's second line was 122)."""
    text = textwrap.fill(" ".join(header.split()), width=LOCK_WIDTH - 2, break_on_hyphens=False)
    return "".join(f"# {line}\n" for line in text.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", type=Path, default=Path(sys.executable), help="default: this interpreter")
    parser.add_argument("--compile", action="store_true", help="byte-compile what is installed (as pip does)")
    parser.add_argument("--bootstrap", action="store_true", help=f"first install {UV_REQUIREMENT} beside it")
    parser.add_argument(
        "--write-lock", type=Path, help="write the environment's pins there (lock_pins) and stop"
    )
    parser.add_argument("requirements", nargs=argparse.REMAINDER, help="what to install, as pip takes it")
    args = parser.parse_args(argv)
    requirements = [r for r in args.requirements if r != "--"]
    if args.write_lock:
        print(f"{args.write_lock}: {write_lock(args.python, args.write_lock, LOCK_HEADER)} packages pinned")
        return 0
    if args.bootstrap:
        bootstrap()
    try:
        install(args.python, requirements, args.compile)
    except subprocess.CalledProcessError as error:
        print(f"install of {' '.join(requirements)} failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
