"""The thread policy (settings.thread_policy): what each kind of child gets, that a lab's setting wins, and that it
reaches torch in this process and the environment of an engine the project starts (bench/threads.py shows why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nexa_dagster import settings
from nexa_dagster.core.common import threads
from nexa_dagster.core.llm import managed_server
from nexa_dagster.core.llm.managed_server import ManagedServer

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
POLICY_VARIABLES = ("NEXA_THREADS", "NEXA_OMP_WAIT_POLICY", "NEXA_SIDE_BY_SIDE", "PYTEST_XDIST_WORKER_COUNT")
SHIPPED_MODEL = next(Path(threads.__file__).parents[1].glob("tiny/weights/tiny-pretrained-*"))


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eight-core machine with no policy setting and no xdist worker count (the suite runs under one)."""
    monkeypatch.setattr(settings, "usable_cores", lambda: 8)
    for name in POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def threads_of(env: dict[str, str]) -> tuple[int, str]:
    counts = {env[name] for name in THREAD_VARIABLES}
    assert len(counts) == 1, {name: env[name] for name in THREAD_VARIABLES}  # OpenMP, MKL, OpenBLAS agree
    return int(counts.pop()), env["OMP_WAIT_POLICY"]


@pytest.mark.usefixtures("eight_cores")
def test_a_child_gets_its_share_of_the_cores_and_threads_that_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, a process has every core; ranks and pool workers split them; processes side by side (the suite's
    xdist workers, or a lab's NEXA_SIDE_BY_SIDE) split them again; never fewer than one. Idle threads sleep."""
    assert {kind: threads_of(settings.child_environ(kind)) for kind in settings.PROCESS_KINDS} == {
        kind: (8, "PASSIVE") for kind in settings.PROCESS_KINDS
    }
    assert threads_of(settings.child_environ("training", alongside=4)) == (2, "PASSIVE")
    assert threads_of(settings.child_environ("shards", alongside=3)) == (2, "PASSIVE")  # 8 // 3
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert threads_of(settings.child_environ("engine")) == (4, "PASSIVE")
    assert threads_of(settings.child_environ("training", alongside=4)) == (1, "PASSIVE")
    assert threads_of(settings.child_environ("training", alongside=16)) == (1, "PASSIVE")  # at least one
    monkeypatch.setenv("NEXA_SIDE_BY_SIDE", "4")  # the lab's count over xdist's
    assert threads_of(settings.child_environ("evaluation")) == (2, "PASSIVE")


@pytest.mark.usefixtures("eight_cores")
def test_the_childs_own_share_replaces_the_threads_its_parent_runs_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that computes with one thread (beside another) still starts a rank with the rank's share: the
    inherited OMP_NUM_THREADS is not passed on as it is."""
    for name in THREAD_VARIABLES:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    child = settings.child_environ("training", alongside=2)
    assert threads_of(child) == (4, "PASSIVE")
    assert child["PATH"] == settings.environ()["PATH"]  # the rest is environ()'s allow-list


@pytest.mark.usefixtures("eight_cores")
def test_a_labs_settings_win_for_every_kind_or_the_kinds_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXA_THREADS", "3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")  # a number the lab gives is not split again
    assert {
        kind: threads_of(settings.child_environ(kind, alongside=2))[0] for kind in settings.PROCESS_KINDS
    } == {kind: 3 for kind in settings.PROCESS_KINDS}
    monkeypatch.setenv("NEXA_THREADS", "engine=1, training=6")  # the others keep the computed share
    monkeypatch.setenv("NEXA_OMP_WAIT_POLICY", "training=active")  # a dedicated node's ranks spin
    assert {kind: threads_of(settings.child_environ(kind)) for kind in settings.PROCESS_KINDS} == {
        "step": (4, "PASSIVE"),
        "training": (6, "ACTIVE"),
        "evaluation": (4, "PASSIVE"),
        "engine": (1, "PASSIVE"),
        "shards": (4, "PASSIVE"),
    }
    monkeypatch.setenv("NEXA_THREADS", "2,evaluation=5")  # a number for all, one kind apart
    assert settings.thread_policy("evaluation").threads == 5 and settings.thread_policy("step").threads == 2


@pytest.mark.usefixtures("eight_cores")
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("NEXA_THREADS", "0", "NEXA_THREADS='0': a whole number of at least 1"),
        ("NEXA_THREADS", "many", "NEXA_THREADS='many': a whole number of at least 1"),
        ("NEXA_THREADS", "gpu=2", "NEXA_THREADS='gpu=2': unknown process kind 'gpu'"),
        ("NEXA_OMP_WAIT_POLICY", "spin", "NEXA_OMP_WAIT_POLICY='spin': a wait policy is one of"),
        ("NEXA_SIDE_BY_SIDE", "-1", "NEXA_SIDE_BY_SIDE='-1': a whole number of at least 1"),
    ],
)
def test_a_setting_that_means_nothing_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        settings.child_environ("training")


def test_an_unknown_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown process kind 'gpu': one of step, training"):
        settings.thread_policy("gpu")


def test_use_resizes_torchs_pool_here_and_sets_what_children_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    for name in (*THREAD_VARIABLES, "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)  # put back after the test, as the pool below
    try:
        threads.use(settings.ThreadPolicy("step", 3, "PASSIVE"))
        assert torch.get_num_threads() == 3
        assert threads_of(settings.environ()) == (3, "PASSIVE")
    finally:
        torch.set_num_threads(before)


def test_a_process_that_loads_torch_after_use_starts_with_the_policy() -> None:
    """The variables are in place before torch loads: its pool is sized from them (libgomp reads its wait policy
    then, and only then)."""
    code = (
        "from nexa_dagster import settings\nfrom nexa_dagster.core.common import threads\n"
        "threads.use(settings.ThreadPolicy('evaluation', 1, 'PASSIVE'))\n"
        "import torch\nprint(torch.get_num_threads())\n"
    )
    env = {k: v for k, v in settings.environ().items() if k not in (*THREAD_VARIABLES, "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1"]


class Spawned(Exception):
    """What the stand-in for Popen raises once it has the engine's environment."""


@pytest.mark.usefixtures("eight_cores")
def test_an_engine_starts_with_the_engine_policy_and_its_own_variables_over_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`transformers serve` gets the engine's share and sleeping threads; a thread count the serving service gives
    an engine loading beside the one that serves (extra_env) wins over it."""
    seen: list[dict[str, str]] = []

    def popen(*args: object, env: dict[str, str], **kwargs: object) -> None:
        seen.append(env)
        raise Spawned

    monkeypatch.setattr(managed_server.subprocess, "Popen", popen)
    monkeypatch.setenv("NEXA_THREADS", "engine=6")
    for extra, expected in (({}, (6, "PASSIVE")), ({"OMP_NUM_THREADS": "1"}, (1, "PASSIVE"))):
        server = ManagedServer(
            SHIPPED_MODEL,
            tmp_path,
            engine="transformers",
            device="cpu",
            continuous_batching=False,
            extra_env=extra,
        )
        with pytest.raises(Spawned):
            server._spawn()
        assert (int(seen[-1]["OMP_NUM_THREADS"]), seen[-1]["OMP_WAIT_POLICY"]) == expected


def test_the_configuration_page_has_the_policy_of_every_kind_as_the_settings_module_does() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert settings.thread_policy_table() in page, (
        "docs/configuration.md's table of process kinds differs from nexa_dagster/settings.py: paste "
        "`python -c 'from nexa_dagster import settings; print(settings.thread_policy_table())'` there"
    )


def test_the_suites_own_worker_computes_with_its_share() -> None:
    """tests/conftest.py applied the step policy before torch loaded: a test worker of `make test` (two xdist
    workers on two cores) computes with one thread, whose idle time is spent asleep, and passes both on."""
    policy = settings.thread_policy("step")
    assert torch.get_num_threads() == policy.threads
    assert threads_of(settings.environ()) == (policy.threads, "PASSIVE")
