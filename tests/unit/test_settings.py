"""Every environment variable in one module, documented: the table in docs/configuration.md is the module's, and a
variable's value is read when asked for, so setting it takes effect without a re-import."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa_dagster import settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_page_lists_every_variable_as_the_settings_module_does() -> None:
    page = DOCS.read_text(encoding="utf-8")
    assert settings.markdown_table() in page, (
        "docs/configuration.md's variable table differs from nexa_dagster/settings.py: paste "
        "`python -c 'from nexa_dagster import settings; print(settings.markdown_table())'` there"
    )
    names = [v.name for v in settings.VARIABLES]
    assert len(names) == len(set(names))


def test_a_variable_is_read_when_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NEXA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_root() == tmp_path / "xdg" / "nexa-dagster"
    monkeypatch.setenv("NEXA_CACHE_DIR", str(tmp_path / "mine"))
    assert settings.cache_root() == tmp_path / "mine"
    monkeypatch.setenv("NEXA_SCALE", "")  # empty counts as unset: the default
    assert settings.SCALE.get() == "tiny" and not settings.SCALE.is_set()


def test_a_child_inherits_what_it_runs_with_and_no_secret_under_any_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """settings.environ() is an allow-list: the project's secret variables, the database URL and secrets under
    names the project never heard of stay out; what workers, engines, pip and sbatch need comes in."""
    planted = {
        **{v.name: "secret" for v in settings.SECRET_VARIABLES},
        "DAGSTER_PG_URL": "postgresql+psycopg2://dagster:hunter2@db:5432/dagster",
        "NEXA_TEST_SECRET": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "HF_TOKEN": "secret",  # under an allowed prefix, but a name that says it is a secret
        "VLLM_API_KEY": "secret",
        "PIP_INDEX_URL": "https://user:token@index/simple",  # pip's own configuration: for pip alone
    }
    needed = {
        "PATH": "/usr/bin",
        "HOME": "/home/nexa",
        "NEXA_DATA_ROOT": "/data",
        "DAGSTER_PIPES_CONTEXT": "x",  # Dagster Pipes' bootstrap
        "MASTER_ADDR": "10.0.0.1",  # torch.distributed's rendezvous
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
        "NEXA_FAULT_STALL_AT_STEP": "2",  # the fault tests' hooks
        "SLURM_CONF": "/etc/slurm/slurm.conf",  # which cluster sbatch reaches
        "CUDA_VISIBLE_DEVICES": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "LC_ALL": "C.UTF-8",
    }
    for name, value in {**planted, **needed}.items():
        monkeypatch.setenv(name, value)
    child = settings.environ()
    assert not set(planted) & set(child), sorted(set(planted) & set(child))
    assert {k: child.get(k) for k in needed} == needed
    assert settings.environ(settings.PIP)["PIP_INDEX_URL"] == planted["PIP_INDEX_URL"]
    assert "DAGSTER_PG_URL" not in settings.environ(settings.PIP)


def test_a_secret_file_is_read_and_one_that_cannot_be_is_an_error_naming_variable_and_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    [teacher_key_file] = [v for v in settings.LLM_API_KEY_FILES if v.name == "NEXA_TEACHER_API_KEY_FILE"]
    monkeypatch.delenv(teacher_key_file.name, raising=False)
    assert settings.secret_from_file(teacher_key_file) == ""
    key = tmp_path / "key"
    key.write_text("  sk-in-a-file\n")
    monkeypatch.setenv(teacher_key_file.name, str(key))
    assert settings.secret_from_file(teacher_key_file) == "sk-in-a-file"
    key.write_text("\n")
    with pytest.raises(
        settings.SecretUnreadable, match=f"NEXA_TEACHER_API_KEY_FILE={key}: the file is empty"
    ):
        settings.secret_from_file(teacher_key_file)
    monkeypatch.setenv(teacher_key_file.name, str(tmp_path / "absent"))
    with pytest.raises(settings.SecretUnreadable) as e:
        settings.secret_from_file(teacher_key_file)
    assert f"NEXA_TEACHER_API_KEY_FILE={tmp_path / 'absent'}: the file cannot be read" in str(e.value)
