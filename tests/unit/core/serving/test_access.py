"""Who may use the serving service: secrets from a file only (a value refused, a weak one refused), the key's check
as HAProxy is configured with it (a salted digest, not the key), no secret in a child's environment, the checkpoint folders a switch may load from, and a service that will not listen
off loopback without a key and a token. (The real endpoint answering 401/401/200: tests/integration/
test_serving_endpoint.py.)"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

import pytest

from nexa_dagster import settings
from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.haproxy import render_config
from nexa_dagster.core.serving.service import ServingService

KEY = "FVuCwz5eEKyU2Q-p8gMJHa7XZ8UTFi4rLzKjpv0o0nE"  # secrets.token_urlsafe(32): 252 bits by the estimate
NEW_KEY = "plg72KRSRarJr9eNWS_0cQGDyRZQF6AT4K77F9xSJn0"  # another, the key a rotation brings in


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in (
        settings.SERVING_API_KEY,
        settings.SERVING_API_KEY_FILE,
        settings.SERVING_CONTROL_TOKEN,
        settings.SERVING_CONTROL_TOKEN_FILE,
    ):
        monkeypatch.delenv(v.name, raising=False)


def test_a_secret_comes_from_the_file_it_names_and_never_from_a_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clear(monkeypatch)
    assert access.api_key() is None and access.configured_control_token() is None
    secret_file = tmp_path / "api-key"
    secret_file.write_text(f"{KEY}\n")  # a secret file usually ends with a newline
    monkeypatch.setenv("NEXA_SERVING_API_KEY_FILE", str(secret_file))
    assert access.api_key() == KEY and access.api_keys() == [KEY]
    secret_file.write_text(f"# rotating\n{KEY}\n\n{NEW_KEY}\n")  # two keys while one replaces the other
    assert access.api_keys() == [KEY, NEW_KEY]
    monkeypatch.setenv("NEXA_SERVING_API_KEY", KEY)  # a value, which every child would inherit: refused
    with pytest.raises(access.SecretMissing, match="NEXA_SERVING_API_KEY gives a secret as a value"):
        access.api_keys()
    monkeypatch.setenv("NEXA_SERVING_CONTROL_TOKEN", KEY)
    with pytest.raises(access.SecretMissing, match="set NEXA_SERVING_CONTROL_TOKEN_FILE to that file's path"):
        access.configured_control_token()


@pytest.mark.parametrize(
    ("secret", "refused"),
    [
        ("sk-lab-7c1f9e22b0", True),  # short: 74 bits (two words, then 10 hex digits)
        ("0123456789abcdef0123456789abcde", True),  # a run, then a repeat of it: 26 bits
        ("0d0cc3b88a49368150c9a5ebb030bde13d2c7e73cdccdac9e1d1ed7125914c7f", False),  # token_hex(32): 256
        ("12345678901234567890123456789012345678", True),  # a run, then repeats: 20 bits
        ("correct horse battery staple", True),  # a passphrase of words: far under its length's bits
        ("password-password-pass", True),  # 132 bits by length x alphabet; a repeat: 47
        ("abcdefgh" * 4, True),  # 150 bits by length x alphabet; a run, then repeats: 17
        ("sk-lab-endpoint-5d0c93e1a7", True),  # 156 by length x alphabet; words and 10 hex digits: 107
        ("Zm9vYmFy-_Zm9vYmFy-_Zm", True),  # 22 base64url characters, but a repeat: 58
        ("plg72KRSRarJr9eNWS_0cQGDyRZQF6AT4K77F9xSJn0", False),  # token_urlsafe(32): 252
    ],
)
def test_a_secret_under_128_bits_is_refused_naming_its_file_and_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, secret: str, refused: bool
) -> None:
    _clear(monkeypatch)
    (tmp_path / "key").write_text(f"{KEY}\n{secret}\n")
    monkeypatch.setenv("NEXA_SERVING_API_KEY_FILE", str(tmp_path / "key"))
    if refused:
        with pytest.raises(
            access.SecretMissing, match=f"{tmp_path}/key \\(line 2, NEXA_SERVING_API_KEY_FILE\\)"
        ):
            access.api_keys()
    else:
        assert access.api_keys()[1] == secret


def test_the_estimate_reads_repeats_runs_and_parts_and_passes_every_random_256_bit_key() -> None:
    """``secret_bits`` is the bits of a short description of the key: a random key keeps about its length times
    log2 of its alphabet, a pattern costs only its place and length, a part between separators counts in its own
    alphabet. Every fresh 256-bit key passes (1000 of each kind; the lowest of 20 000 measured: 220 bits)."""
    assert access.secret_bits("abcdefgh" * 4) < 20  # a run (abcdefgh), then a repeat of 24 characters
    assert access.secret_bits("password-password-pass") < 50  # "password", then a repeat of 13
    assert 100 < access.secret_bits("sk-lab-endpoint-5d0c93e1a7") < 110  # sk, lab, endpoint, hex digits
    assert access.secret_bits(KEY) > 230
    assert access.secret_bits("a" * 1000 + KEY) < 300  # a long line stays quick, and a run costs little
    for make in (secrets.token_urlsafe, secrets.token_hex):
        lowest = min(access.secret_bits(make(32)) for _ in range(1000))
        assert lowest > 190, (make.__name__, lowest)


def test_a_secret_file_others_may_write_is_refused_and_one_they_may_read_warned_of(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _clear(monkeypatch)
    key = tmp_path / "key"
    key.write_text(f"{KEY}\n")
    monkeypatch.setenv("NEXA_SERVING_API_KEY_FILE", str(key))
    key.chmod(0o620)  # group-writable: whoever may write it may add a key of their own
    with pytest.raises(access.SecretMissing, match=r"which other users may write \(mode 0620\)"):
        access.api_keys()
    key.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger=access.__name__):
        assert access.api_keys() == [KEY]
        assert caplog.records == []
        key.chmod(0o644)
        assert access.api_keys() == [KEY] and access.api_keys() == [KEY]
    [warned] = [r.getMessage() for r in caplog.records]  # once, not at every read
    assert f"{key}, which other users may read (mode 0644)" in warned and "chmod 600" in warned


def test_no_child_process_inherits_a_serving_secret_or_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {v.name for v in settings.SECRET_VARIABLES}
    assert {
        "NEXA_TEACHER_API_KEY",
        "NEXA_JUDGE_API_KEY",
        "NEXA_POLICY_API_KEY",
    } <= names  # the LLM endpoints'
    for v in settings.SECRET_VARIABLES:
        monkeypatch.setenv(v.name, "x")
    monkeypatch.setenv("NEXA_DATA_ROOT", "/data")
    child = settings.environ()
    assert not {v.name for v in settings.SECRET_VARIABLES} & set(child)
    assert child["NEXA_DATA_ROOT"] == "/data"  # the rest is inherited


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


def test_haproxy_is_given_a_salted_digest_of_the_header_never_the_key(tmp_path: Path) -> None:
    salt = access.new_salt()
    digest = access.bearer_digest(KEY, salt)
    assert digest == hmac.new(salt, f"Bearer {KEY}".encode(), hashlib.sha256).hexdigest().upper()
    assert digest != access.bearer_digest(KEY, access.new_salt())  # another deployment: another digest
    engines = {"blue": tmp_path / "blue.sock", "green": tmp_path / "green.sock"}
    config = render_config(
        8000, engines, tmp_path / "p.sock", tmp_path / "s.sock", salt=salt, digests_file=tmp_path / "k.acl"
    )
    assert KEY not in config and digest not in config  # the digests are in k.acl, changed at run time
    salt64 = base64.b64encode(salt).decode()
    assert f"req.fhdr(authorization),hmac(sha256,{salt64}),hex -m str -f {tmp_path}/k.acl" in config
    assert config.count("http-request return status 401") == 2  # missing, wrong: each its message
    assert config.index("status 401") < config.index("del-header authorization") < config.index("use_backend")
    assert f"server blue unix@{tmp_path}/blue.sock" in config and config.count("127.0.0.1:") == 1  # bind only
    open_config = render_config(8000, engines, tmp_path / "p.sock", tmp_path / "s.sock")
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
    (tmp_path / "configured").write_text(KEY)
    monkeypatch.setenv("NEXA_SERVING_CONTROL_TOKEN_FILE", str(tmp_path / "configured"))
    assert access.local_control_token(tmp_path) == KEY
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
    with pytest.raises(access.SecretMissing, match="on 0.0.0.0 with no API key: write one to a file"):
        ServingService(**common, host="0.0.0.0", control_token="t")
    with pytest.raises(
        access.SecretMissing, match="no token of its own: set NEXA_SERVING_CONTROL_TOKEN_FILE"
    ):
        ServingService(**common, host="0.0.0.0", control_host="0.0.0.0", api_keys=[KEY])
    # off loopback with a key, the control API on loopback (the default): its token may be issued at start
    assert ServingService(**common, host="0.0.0.0", api_keys=[KEY]).api_key == KEY
    assert ServingService(**common, host="0.0.0.0", api_keys=[KEY]).base_url == "http://127.0.0.1:8000/v1"
    assert ServingService(**common, host="127.0.0.2", api_keys=[KEY]).base_url == "http://127.0.0.2:8000/v1"
    assert ServingService(**common).api_key is None  # loopback: open, and the token is issued at start


def test_two_key_reloads_within_one_second_are_told_apart(tmp_path: Path) -> None:
    """What a rotation waits on (GET /status): a reload counter, and a time to the microsecond (with one-second
    resolution, a second reload in the same second looked like none)."""

    class Router:
        def set_keys(self, keys: list[str]) -> tuple[int, int]:
            return 1, 0

    keys = [KEY]
    service = ServingService(
        tmp_path, str(tmp_path / "p.json"), 8000, api_keys=keys, reload_api_keys=lambda: list(keys)
    )
    service.router = Router()  # type: ignore[assignment]
    seen = [service.status()]
    for new in (NEW_KEY, KEY):
        keys.append(new)
        assert service.reload_keys()
        seen.append(service.status())
    assert [s["api_keys_reloads"] for s in seen] == [0, 1, 2]
    assert [s["api_keys"] for s in seen] == [1, 2, 3]
    stamps = [s["api_keys_loaded_at"] for s in seen]
    assert stamps == sorted(set(stamps)), stamps  # three distinct times, in order, all within a second or so
