"""pip's configuration read and translated into uv's options: where packages come from must not change with the
installer (this machine's wheels on disk and constraints file are pip's configuration, and so is a lab's mirror)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nexa_dagster.core.common.installer import Untranslatable, install, lock_pins, pip_options, uv_options

# `pip config list` on a machine like the CI's: a global file, a PIP_* variable, and a [freeze] section
LISTING = """\
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
freeze.find-links='/not/for/install'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/overridden/by/the/variable'
install.constraint='/etc/install-constraints.txt'
install.no-input=unquoted
"""


def test_the_variable_overrides_the_install_section_over_global_and_other_commands_do_not_count() -> None:
    assert pip_options(LISTING) == {
        "default-timeout": "180",
        "disable-pip-version-check": "1",
        "find-links": "/opt/wheels",
        "cert": "/etc/ssl/certs/ca-certificates.crt",
        "constraint": "/etc/install-constraints.txt",
        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "no-input": "unquoted",
    }


def test_where_packages_come_from_goes_to_uv_which_picks_the_best_version_across_indexes_as_pip() -> None:
    options = uv_options(pip_options(LISTING))
    args = list(options.args)
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(args[2::2], args[3::2], strict=True))
    assert sorted(pairs) == [
        ("--constraint", "/etc/install-constraints.txt"),
        ("--extra-index-url", "file:///opt/pypi-more/simple"),
        ("--extra-index-url", "file:///opt/pypi/simple"),
        ("--find-links", "/opt/wheels"),
    ]
    assert options.env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


def test_an_index_url_a_false_flag_and_a_true_one() -> None:
    options = uv_options({"index-url": "https://mirror.example/simple", "no-index": "false", "pre": "yes"})
    assert list(options.args) == [
        "--index-strategy",
        "unsafe-best-match",
        "--index-url",
        "https://mirror.example/simple",
        "--prerelease=allow",
    ]


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False)]
)
def test_a_flag_is_on_as_pip_reads_it(value: str, on: bool) -> None:
    """pip's own spellings of a boolean (``PIP_NO_INDEX=1`` is the usual one): a flag missed would make uv reach an
    index the configuration turned off."""
    assert ("--no-index" in uv_options({"no-index": value}).args) is on


def test_uv_gets_pip_s_and_uv_s_variables_and_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uv process, a real one (a script standing in for uv that records its environment): its own ``UV_*``
    settings and pip's reach it; an API key the launching process holds does not."""
    seen = tmp_path / "environment"
    uv = tmp_path / "uv"
    uv.write_text(f"#!/bin/sh\nenv > {seen}\n")
    uv.chmod(0o755)
    monkeypatch.setenv("UV_CONCURRENT_DOWNLOADS", "4")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("NEXA_TEACHER_API_KEY", "sk-not-for-uv")
    monkeypatch.setenv("CLOUD_DEPLOY_CREDENTIALS", "not-for-uv-either")
    assert install(Path(sys.executable), ["nothing-installed"], compile_bytecode=False, uv=uv) == "uv"
    environment = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
    assert environment["UV_CONCURRENT_DOWNLOADS"] == "4" and environment["PIP_NO_CACHE_DIR"] == "1"
    assert "NEXA_TEACHER_API_KEY" not in environment and "CLOUD_DEPLOY_CREDENTIALS" not in environment


@pytest.mark.parametrize("option", ["only-binary", "no-binary", "require-hashes", "use-feature"])
def test_an_option_that_changes_what_pip_would_install_is_refused_by_name(option: str) -> None:
    """Silently dropped, such an option would install something other than what pip would: the install is pip's."""
    with pytest.raises(Untranslatable, match=f"pip's option {option}="):
        uv_options({"find-links": "/opt/wheels", option: ":all:"})


def test_the_lock_pins_name_and_version_sorted_without_local_labels_or_the_installer_s_own() -> None:
    freeze = "uv==0.13.10\nPyYAML==6.0.3\ntorch==2.13.0+cpu\naccelerate==1.16.0\npip==23.2.1\n\n"
    assert lock_pins(freeze) == ["accelerate==1.16.0", "PyYAML==6.0.3", "torch==2.13.0"]


@pytest.mark.parametrize("line", ["mylib @ file:///home/me/mylib", "git+https://example.org/lib.git#egg=lib"])
def test_a_package_from_a_path_or_a_url_is_not_a_pin_another_machine_can_meet(line: str) -> None:
    with pytest.raises(ValueError, match="is not name==version"):
        lock_pins(f"accelerate==1.16.0\n{line}\n")
