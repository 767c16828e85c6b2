"""`make install` and a checkout that moved: a ``.venv`` built at another path (its scripts' shebangs and the
editable install point there) is rebuilt, one built here is left alone. The project's real Makefile, run by
`make -n` (what it would do) in a copy of the checkout's files, with ``.venv`` files as a build leaves them."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from nexa_dagster.core.common.config import REPO_ROOT

INSTALLER = "nexa_dagster/core/common/installer.py"  # what `make install` installs with (uv, or pip)
LOCK = "constraints.txt"  # the versions it installs


def _checkout(tmp_path: Path, built_at: str | None, stamp: str | None) -> Path:
    """A checkout at ``tmp_path/checkout`` with a ``.venv`` built at ``built_at`` (its pip's shebang), whose stamp
    holds ``stamp`` (None: no stamp, an empty string: the stamp older makes wrote)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("Makefile", "pyproject.toml", "dagster.yaml", INSTALLER, LOCK):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, checkout / name)
    if built_at is not None:
        (checkout / ".venv" / "bin").mkdir(parents=True)
        (checkout / ".venv" / "bin" / "pip").write_text(
            f"#!{built_at}/.venv/bin/python3.11\nimport sys\nfrom pip._internal.cli.main import main\n"
        )
    if stamp is not None:
        (checkout / ".venv" / ".installed").write_text(f"{stamp}\n" if stamp else "")
    earlier = time.time() - 60  # both older than the stamp: only the path can make the .venv stale
    for name in ("pyproject.toml", INSTALLER, LOCK):
        os.utime(checkout / name, (earlier, earlier))
    return checkout


def _dry_run(checkout: Path, target: str = "install") -> str:
    proc = subprocess.run(
        ["make", "-n", target], cwd=checkout, capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("stamp", ["elsewhere", "old-empty-stamp"])
def test_a_venv_built_for_another_path_is_rebuilt(tmp_path: Path, stamp: str) -> None:
    elsewhere = str(tmp_path / "old-place" / "checkout")
    checkout = _checkout(tmp_path, elsewhere, elsewhere if stamp == "elsewhere" else "")
    out = _dry_run(checkout)
    assert "-m venv --clear .venv" in out, out  # from nothing: its scripts point at the old place
    assert "installer --compile --bootstrap -- -c constraints.txt torch==2.13.0" in out, out
    assert "installer --compile -- -c constraints.txt -e . " in out and "'.[dev]'" not in out, out
    assert f'echo "{checkout}" > .venv/.installed' in out, out
    assert "not " + str(checkout) in out and "rebuilding it" in out, out
    # the tests' and lint's install rebuilds it too, then adds the dev extra on the new .venv
    dev = _dry_run(checkout, "install-dev")
    assert "-m venv --clear .venv" in dev and dev.index("-e . ") < dev.index("-e '.[dev]'"), dev


@pytest.mark.parametrize("stamp", ["here", "old-empty-stamp"])
def test_a_venv_built_here_is_left_alone(tmp_path: Path, stamp: str) -> None:
    here = str(tmp_path / "checkout")
    checkout = _checkout(tmp_path, here, here if stamp == "here" else "")
    out = _dry_run(checkout)
    assert "Nothing to be done for 'install'" in out, out
    assert "pip install" not in out and "rebuilding" not in out, out


def test_make_run_s_install_leaves_the_dev_extra_to_the_tests(tmp_path: Path) -> None:
    """`make run` installs the runtime only; the first `make test`, `lint` or `ui` on that .venv adds the dev extra
    (pytest, ruff, dg...) without rebuilding the .venv, and once added it is not installed again."""
    here = str(tmp_path / "checkout")
    checkout = _checkout(tmp_path, here, here)
    run = subprocess.run(
        ["make", "-n", "run"], cwd=checkout, capture_output=True, text=True, timeout=60, check=True
    )
    assert "'.[dev]'" not in run.stdout, run.stdout
    dev = _dry_run(checkout, "install-dev")
    assert "-c constraints.txt -e '.[dev]'" in dev and "-m venv" not in dev, dev
    (checkout / ".venv" / ".installed-dev").touch()
    assert "Nothing to be done for 'install-dev'" in _dry_run(checkout, "install-dev")


@pytest.mark.parametrize("changed", [INSTALLER, LOCK])
def test_a_changed_installer_or_lock_installs_again_into_the_same_venv(tmp_path: Path, changed: str) -> None:
    """How the install is done (core/common/installer.py) or what it installs (constraints.txt, after `make lock`)
    changed: `make install` runs it again on the .venv built here, which keeps what it has (nothing rebuilt from
    nothing; uv and pip move each package to its locked version)."""
    here = str(tmp_path / "checkout")
    checkout = _checkout(tmp_path, here, here)
    later = time.time() + 60  # newer than the stamp (a touch now could share the stamp's clock tick)
    os.utime(checkout / changed, (later, later))
    out = _dry_run(checkout)
    assert "-c constraints.txt -e . " in out and "--clear" not in out and "rebuilding" not in out, out
