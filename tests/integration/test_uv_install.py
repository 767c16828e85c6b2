"""The installer on real environments: uv installs (byte-compiled when asked), and pip installs the same where uv
fails or cannot be given pip's configuration, saying why. A wheel built here, so nothing is downloaded."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nexa_dagster.core.common.installer import install, uv_binary, write_lock

NAME, VERSION = "nexa_installer_probe", "1.0"


def build_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one module (``VALUE = 42``), with the metadata and RECORD both installers check."""
    info = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}/__init__.py": b"VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = folder / f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def new_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def imports_it(python: Path) -> bool:
    done = subprocess.run(
        [str(python), "-c", f"import {NAME}; assert {NAME}.VALUE == 42"], capture_output=True, check=False
    )
    return done.returncode == 0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_make_install_puts_uv_beside_the_projects_python_and_it_installs_byte_compiled(
    tmp_path: Path, wheel: Path
) -> None:
    uv = uv_binary()
    assert uv is not None, "make install installs uv beside the project's Python (core/common/installer.py)"
    python = new_venv(tmp_path / "venv")
    logged: list[str] = []
    assert install(python, [str(wheel)], compile_bytecode=True, log=logged.append) == "uv", logged
    assert imports_it(python) and logged == []
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    assert list((site / NAME / "__pycache__").glob("__init__.*.pyc"))


def test_the_lock_of_a_real_environment_pins_what_an_index_served_and_refuses_a_path(
    tmp_path: Path, wheel: Path
) -> None:
    """`make lock`'s last step (``write_lock``) on a real environment: the package an index (here a folder of wheels)
    served is pinned under the header; one installed from a file path is refused by name, the old lock kept."""
    python = new_venv(tmp_path / "venv")
    assert (
        install(python, ["--no-index", "--find-links", str(wheel.parent), NAME], compile_bytecode=False)
        == "uv"
    )
    lock = tmp_path / "constraints.txt"
    long = "what it is, " * 12  # 144 characters: refilled into lines of 110 at most
    assert write_lock(python, lock, f"{long}\nhow it is made") == 1
    header, pins = lock.read_text().split("\n# Resolved ")
    assert [len(line) <= 110 for line in header.splitlines()] == [True, True]
    assert " ".join(line.removeprefix("# ") for line in header.splitlines()) == f"{long}how it is made"
    assert pins.splitlines()[1:] == [f"{NAME}=={VERSION}"]
    assert install(python, ["--reinstall", str(wheel)], compile_bytecode=False) == "uv"  # now from its path
    with pytest.raises(ValueError, match=f"'{NAME} @ file://"):
        write_lock(python, lock, "a new lock")
    assert lock.read_text().startswith("# what it is, what it is")


def test_where_uv_fails_pip_installs_the_same_and_the_log_says_why(tmp_path: Path, wheel: Path) -> None:
    broken = tmp_path / "uv"
    broken.write_text("#!/bin/sh\necho 'error: no route to the index' >&2\nexit 2\n")
    broken.chmod(0o755)
    python = new_venv(tmp_path / "venv")
    logged: list[str] = []
    assert install(python, [str(wheel)], compile_bytecode=False, log=logged.append, uv=broken) == "pip"
    assert imports_it(python)
    assert len(logged) == 1 and "uv failed (exit 2): error: no route to the index" in logged[0], logged


def test_a_pip_option_uv_cannot_honour_makes_the_install_pips_naming_it(
    tmp_path: Path, wheel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PIP_NO_BINARY``, set for one package: uv would ignore it and could install that package as a wheel."""
    monkeypatch.setenv("PIP_NO_BINARY", "some-package")
    python = new_venv(tmp_path / "venv")
    logged: list[str] = []
    uv = uv_binary() or Path("/nonexistent/uv")
    assert install(python, [str(wheel)], compile_bytecode=False, log=logged.append, uv=uv) == "pip"
    assert imports_it(python)
    assert logged and "pip's option no-binary='some-package' has no uv equivalent" in logged[0], logged
