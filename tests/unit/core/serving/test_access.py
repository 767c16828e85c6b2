"""Who may use the serving service: secrets from a variable or a file, the key's check as HAProxy is configured
with it (a digest, not the key), the checkpoint folders a switch may load from, and a service that will not listen
off loopback without a key and a token. (The real endpoint answering 401/401/200: tests/integration/
test_serving_endpoint.py.)"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from nexa_dagster import settings
from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.haproxy import render_config
from nexa_dagster.core.serving.service import ServingService

KEY = "sk-lab-7c1f9e22b0"


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in (
        settings.SERVING_API_KEY,
        settings.SERVING_API_KEY_FILE,
        settings.SERVING_CONTROL_TOKEN,
        settings.SERVING_CONTROL_TOKEN_FILE,
    ):
        monkeypatch.delenv(v.name, raising=False)


def test_a_secret_comes_from_its_variable_or_from_the_file_it_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clear(monkeypatch)
    assert access.api_key() is None and access.configured_control_token() is None
    secret_file = tmp_path / "api-key"
    secret_file.write_text(f"{KEY}\n")  # a secret file usually ends with a newline
    monkeypatch.setenv("NEXA_SERVING_API_KEY_FILE", str(secret_file))
    assert access.api_key() == KEY
    monkeypatch.setenv("NEXA_SERVING_API_KEY", "from-the-variable")  # the variable wins
    assert access.api_key() == "from-the-variable"


def test_a_secret_file_that_is_missing_or_empty_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clear(monkeypatch)
    monkeypatch.setenv("NEXA_SERVING_CONTROL_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(
        access.SecretMissing, match=f"NEXA_SERVING_CONTROL_TOKEN_FILE names {tmp_path}/absent"
    ):
        access.configured_control_token()
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("NEXA_SERVING_CONTROL_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(access.SecretMissing, match="which is empty"):
        access.configured_control_token()


def test_haproxy_is_given_the_digest_of_the_header_never_the_key(tmp_path: Path) -> None:
    digest = access.bearer_digest(KEY)
    assert digest == hashlib.sha256(f"Bearer {KEY}".encode()).hexdigest().upper()
    config = render_config(
        8000, {"blue": 9001, "green": 9002}, 9000, tmp_path / "s.sock", api_key_digest=digest
    )
    assert KEY not in config and digest in config
    assert (
        "req.fhdr(authorization),sha2(256),hex -m str" in config
    )  # the whole header: a comma cannot split it
    assert config.count("http-request return status 401") == 2  # missing, wrong: each its message
    assert config.index("status 401") < config.index("del-header authorization") < config.index("use_backend")
    open_config = render_config(8000, {"blue": 9001, "green": 9002}, 9000, tmp_path / "s.sock")
    assert "401" not in open_config and "authorization" not in open_config


def test_a_control_token_issued_by_the_service_is_readable_by_its_owner_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clear(monkeypatch)
    token = access.issue_control_token(tmp_path)
    assert len(token) >= 40 and (tmp_path / access.TOKEN_FILE).read_text() == token
    assert (tmp_path / access.TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert access.local_control_token(tmp_path) == token
    assert access.issue_control_token(tmp_path) != token  # a fresh one at each start
    monkeypatch.setenv("NEXA_SERVING_CONTROL_TOKEN", "configured")
    assert access.local_control_token(tmp_path) == "configured"
    assert access.same_secret("configured", "configured") and not access.same_secret(
        "configure", "configured"
    )
    assert not access.same_secret(None, "configured")


def test_a_checkpoint_outside_the_allowed_folders_is_refused_links_and_dots_resolved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    checkpoints, elsewhere = tmp_path / "data" / "checkpoints", tmp_path / "elsewhere"
    (checkpoints / "c1").mkdir(parents=True)
    (elsewhere / "m").mkdir(parents=True)
    (checkpoints / "sneaky").symlink_to(elsewhere / "m")
    monkeypatch.delenv("NEXA_SERVING_CHECKPOINT_ROOTS", raising=False)
    roots = access.checkpoint_roots(checkpoints)
    assert roots == [checkpoints]
    assert access.outside_roots(str(checkpoints / "c1"), roots) is None
    for path in (elsewhere / "m", checkpoints / "sneaky", checkpoints / ".." / ".." / "elsewhere" / "m"):
        reason = access.outside_roots(str(path), roots)
        assert reason is not None and "NEXA_SERVING_CHECKPOINT_ROOTS adds one" in reason, path
    monkeypatch.setenv(
        "NEXA_SERVING_CHECKPOINT_ROOTS", os.pathsep.join([str(elsewhere), str(tmp_path / "x")])
    )
    roots = access.checkpoint_roots(checkpoints)
    assert access.outside_roots(str(checkpoints / "sneaky"), roots) is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("serving", False),
    ],
)
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert access.is_loopback(host) is loopback


def test_the_service_will_not_listen_off_loopback_without_a_key_or_a_token(tmp_path: Path) -> None:
    common = {"serving_dir": tmp_path, "production_pointer": str(tmp_path / "p.json"), "port": 8000}
    with pytest.raises(access.SecretMissing, match="on 0.0.0.0 with no API key: set NEXA_SERVING_API_KEY"):
        ServingService(**common, host="0.0.0.0", control_token="t")
    with pytest.raises(access.SecretMissing, match="no token of its own: set NEXA_SERVING_CONTROL_TOKEN"):
        ServingService(**common, host="0.0.0.0", api_key=KEY)
    assert ServingService(**common, host="0.0.0.0", api_key=KEY, control_token="t").api_key == KEY
    assert ServingService(**common).api_key is None  # loopback: open, and the token is issued at start
