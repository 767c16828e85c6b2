"""Which vLLM environment `make vllm` keeps and which it installs again: a stamp for another device, another lock,
an interrupted install or no harness is installed again; the same lock is kept."""

from __future__ import annotations

import pytest

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
