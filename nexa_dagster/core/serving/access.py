"""Who may use the serving service: the API key(s) of the public endpoint and the token of its control API.

Both are secrets a person provides as files (a Docker or Kubernetes secret mounted read-only), never as values in
the environment: a value there is inherited by every process started after it and readable in
``/proc/<pid>/environ`` for as long as that process lives, while a file is read once by the one process that needs
it. Neither is ever written to the production pointer, ``service.json``, a log line or Dagster metadata: HAProxy is
given only a salted HMAC-SHA-256 of the expected ``Authorization`` header (haproxy.py), so its configuration holds
no secret; the control API compares tokens in constant time. Every secret a person configures must carry at least
128 bits (``secret_bits``): with that, a salted fast hash is as safe as a slow one (no guess list reaches 2^128).

The key file holds one key a line: during a rotation it holds two (the old and the new), both valid; the service
re-reads it on SIGHUP (docs/security.md). Without a configured control token the service makes a fresh one at
every start and writes it, readable by its owner only, to ``<serving dir>/control-token``, where the pipeline on
the same host reads it: whoever may read the data root may already move the production pointer, which the service
follows, so the file grants nothing more.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import secrets
import string
from pathlib import Path

from nexa_dagster import settings

log = logging.getLogger(__name__)

TOKEN_FILE = "control-token"
CONTROL_TOKEN_HEADER = "Authorization"
MIN_SECRET_BITS = 128  # NIST SP 800-131A's floor for a symmetric key (MAKE_ONE makes 256: a margin over it)
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
# the smallest of these alphabets that holds every character of a part of a secret sets its bits per character
_ALPHABETS = (
    string.digits,
    string.hexdigits.lower(),
    string.digits + "ABCDEF",
    string.ascii_lowercase,
    string.ascii_lowercase + string.digits,
    string.ascii_letters + string.digits,
    string.ascii_letters + string.digits + "-_",  # base64url, what secrets.token_urlsafe writes
    string.ascii_letters + string.digits + "+/=",
    string.ascii_letters + string.digits + "-_+/=.~",
    "".join(chr(c) for c in range(33, 127)),  # any printable ASCII but the space
)
# what joins the parts of a key written by hand (`sk-lab-prod-...`): each costs 2 bits, its place being predictable
_SEPARATORS = frozenset("-_.:/+=~,;@")
_SEPARATOR_BITS = 2.0
# a repeat of an earlier stretch, or a run (aaaa, abcd, 9876), of at least this many characters is a pattern; three
# happen by chance in a random key often enough (about 1 in 4 of 32 hex digits) to refuse random keys at the floor
_MIN_PATTERN = 4
_WINDOW = 1024  # how far back a repeat is looked for (a long line stays quick to check)


class SecretMissing(RuntimeError):
    """A secret the service needs is not configured, is too weak, or its file cannot be read."""


def _alphabet_bits(part: str) -> float:
    chars = set(part)
    return math.log2(next((len(set(a)) for a in _ALPHABETS if chars <= set(a)), 256))


def _literal_bits(secret: str) -> list[float]:
    """Per character, what it costs when nothing before predicts it: a separator 2 bits; any other character
    log2 of the smallest alphabet holding its part (the stretch between separators): `sk-lab-` is two words in
    lower case, not 7 characters of base64url."""
    costs, part = [], ""
    for c in [*secret, None]:
        if c is None or c in _SEPARATORS:
            costs += [_alphabet_bits(part)] * len(part)
            part = ""
            if c is not None:
                costs.append(_SEPARATOR_BITS)
        else:
            part += c
    return costs


def _pattern_at(secret: str, i: int) -> tuple[int, float]:
    """The longest pattern starting at ``i`` (characters, bits to describe it): a run that goes on from the
    character before with one step of -1, 0 or +1 (its step and length), or a repeat of an earlier stretch (where
    it is and its length)."""
    run = 0
    if i > 0:
        step = ord(secret[i]) - ord(secret[i - 1])
        while (
            abs(step) <= 1
            and i + run < len(secret)
            and ord(secret[i + run]) - ord(secret[i + run - 1]) == step
        ):
            run += 1
    repeat = 0
    for j in range(
        max(0, i - _WINDOW), i
    ):  # the earlier start that matches longest (may overlap: LZ77's copy)
        n = 0
        while i + n < len(secret) and secret[j + n] == secret[i + n]:
            n += 1
        repeat = max(repeat, n)
    if run + 1 >= _MIN_PATTERN and run >= repeat:
        return run, 2.0 + math.log2(run)
    if repeat >= _MIN_PATTERN:
        return repeat, math.log2(min(i, _WINDOW)) + math.log2(repeat)
    return 0, 0.0


def secret_bits(secret: str) -> float:
    """An estimate of the secret's entropy from its own structure: the bits of a short description of it, read
    left to right, where a character that nothing before predicts costs log2 of its part's alphabet
    (``_literal_bits``) and a repeat or a run of 4 or more costs only its place and length (``_pattern_at``).

    A random key gets close to its length times log2 of its alphabet (what it has), a key with a pattern far less:
    `abcdefgh` * 4 is 17 bits, not 150. It is an estimate from one sample, so it can only credit what it sees: it
    does not know words (`CorrectHorseBattery...` counts as random letters), and a random key exactly at the floor
    (``token_hex(16)``) is refused when a run or a repeat happens to fall in it: keys of 256 bits (``MAKE_ONE``)
    pass with a wide margin."""
    literal, bits, i = _literal_bits(secret), 0.0, 0
    while i < len(secret):
        n, cost = _pattern_at(secret, i)
        if n:
            bits, i = bits + cost, i + n
        else:
            bits, i = bits + literal[i], i + 1
    return bits


def _check_strength(secret: str, where: str) -> None:
    """Refuse what cannot be a random token: whitespace (a phrase of words, whose bits no length tells), fewer
    than 8 distinct characters (a repeated pattern), or fewer than 128 bits by ``secret_bits``."""
    if any(c.isspace() for c in secret) or len(set(secret)) < 8:
        raise SecretMissing(
            f"{where} holds a secret that is not a random token (whitespace, or fewer than 8 distinct "
            f"characters): make one with {MAKE_ONE}"
        )
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS:
        raise SecretMissing(
            f"{where} holds a secret of {len(secret)} characters (about {bits:.0f} bits, estimated from its "
            f"alphabet, its repeats and runs, and its parts between separators): at least {MIN_SECRET_BITS} bits "
            f"are required; make one with {MAKE_ONE}"
        )


def _refuse_value(value: settings.Variable, file: settings.Variable) -> None:
    if value.is_set():
        raise SecretMissing(
            f"{value.name} gives a secret as a value, which every process started from here would inherit "
            f"(/proc/<pid>/environ): write it to a file readable by its owner only (chmod 600) and set "
            f"{file.name} to that file's path instead"
        )


_WARNED: set[tuple[str, int]] = set()


def _check_mode(path: Path, file: settings.Variable) -> None:
    """A secret file others may write is refused: whoever may write it may put in a key of their own. One that
    users other than this one may read (any user, or a group other than this user's own) is used with a loud
    warning, once: inside a container that is a common default (a compose secret taken from the environment is
    0444) and only the container's user runs there; on a shared host it gives the key away."""
    facts = path.stat()  # through links: a Kubernetes Secret's file is a link into ..data/
    mode = facts.st_mode & 0o777
    if mode & 0o022:
        raise SecretMissing(
            f"{file.name} names {path}, which other users may write (mode {mode:04o}): anyone who may write it "
            f"may put a secret of their own in it; `chmod 600 {path}`"
        )
    others = mode & 0o004 or (mode & 0o040 and facts.st_gid != os.getgid())
    if others and (str(path), mode) not in _WARNED:
        _WARNED.add(
            (str(path), mode)
        )  # once per file and mode: the key proxy reads its file every few seconds
        log.warning(
            "WARNING: %s names %s, which other users may read (mode %04o): on a shared host they can read the "
            "secret; `chmod 600 %s` (in a container whose only user is the service's, they are nobody)",
            file.name,
            path,
            mode,
            path,
        )


def read_secrets(value: settings.Variable, file: settings.Variable) -> list[str]:
    """The secrets, one a line, in the file ``file`` names (blank lines and ``#`` comments skipped), each of at
    least 128 bits; [] when ``file`` is unset. A secret given as a value (``value``) is refused."""
    _refuse_value(value, file)
    if not file.is_set():
        return []
    path = Path(file.get())
    try:
        text = path.read_text()
        _check_mode(path, file)
    except OSError as e:
        raise SecretMissing(f"{file.name} names {path}, which cannot be read: {e.strerror or e}") from None
    found = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not found:
        raise SecretMissing(f"{file.name} names {path}, which is empty")
    for number, secret in enumerate(found, 1):
        _check_strength(secret, f"{path} (line {number}, {file.name})")
    return found


def read_secret(value: settings.Variable, file: settings.Variable) -> str | None:
    """The one secret of ``file`` (a second line is an error: only the API key may have two), else None."""
    found = read_secrets(value, file)
    if len(found) > 1:
        raise SecretMissing(
            f"{file.name} names {file.get()}, which holds {len(found)} lines: one secret only"
        )
    return found[0] if found else None


def api_keys() -> list[str]:
    """Every valid key of the endpoint (two while one replaces the other); [] when none is configured."""
    return read_secrets(settings.SERVING_API_KEY, settings.SERVING_API_KEY_FILE)


def api_key() -> str | None:
    """The first configured key (what a client on this host would send), or None."""
    keys = api_keys()
    return keys[0] if keys else None


def configured_control_token() -> str | None:
    return read_secret(settings.SERVING_CONTROL_TOKEN, settings.SERVING_CONTROL_TOKEN_FILE)


def ui_password() -> str:
    """The Dagster UI proxy's password (required: a proxy without one would protect nothing)."""
    password = read_secret(settings.UI_PASSWORD, settings.UI_PASSWORD_FILE)
    if password is None:
        raise SecretMissing(
            f"the UI proxy needs a password: write one to a file (mode 600) and set NEXA_UI_PASSWORD_FILE; make one "
            f"with {MAKE_ONE}"
        )
    return password


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what the service binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_salt() -> bytes:
    """A fresh 128-bit salt for one HAProxy configuration (a digest of one deployment says nothing of another)."""
    return secrets.token_bytes(16)


def header_digest(header: str, salt: bytes) -> str:
    """HMAC-SHA-256 of a whole ``Authorization`` header under ``salt``, upper-case hex: what HAProxy's
    ``hmac(sha256,<salt>),hex`` makes of the request's header (haproxy.py)."""
    return hmac.new(salt, header.encode(), hashlib.sha256).hexdigest().upper()


def bearer_digest(key: str, salt: bytes) -> str:
    """The digest of ``Bearer <key>``."""
    return header_digest(f"Bearer {key}", salt)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much of a guess was right)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def issue_control_token(serving_dir: Path) -> str:
    """A fresh random token in ``<serving_dir>/control-token``, created readable by its owner only."""
    token = secrets.token_urlsafe(32)
    write_private(serving_dir / TOKEN_FILE, token)
    return token


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable and writable by its owner only from its first byte (a temporary file
    created with mode 600, then renamed over ``path``: no moment where another user could open it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner may enter (mode 700): the sockets in it (the engines', the control API's
    public one) are then reachable by this user alone, whatever mode the server gave the socket itself. A folder
    of that name owned by another user (a trap laid in /tmp) is refused."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    facts = path.lstat()
    if facts.st_uid != os.getuid() or not path.is_dir() or path.is_symlink():
        raise SecretMissing(f"{path} is not a folder of this user: refusing to put sockets in it")
    if facts.st_mode & 0o077:
        path.chmod(0o700)
    return path


def local_control_token(serving_dir: Path) -> str | None:
    """The token a pipeline on this host sends: the configured one, else the one the running service issued."""
    if token := configured_control_token():
        return token
    try:
        return (serving_dir / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def checkpoint_roots(data_checkpoints: Path) -> list[Path]:
    """Where the service may load checkpoints from: the data root's ``checkpoints/`` and the configured others."""
    extra = [Path(p) for p in settings.SERVING_CHECKPOINT_ROOTS.get().split(os.pathsep) if p.strip()]
    return [data_checkpoints, *extra]


def outside_roots(checkpoint_path: str, roots: list[Path]) -> str | None:
    """None when ``checkpoint_path`` (links resolved, so ``..`` and links cannot step out) lies under one of
    ``roots``; else why it is refused."""
    resolved = Path(checkpoint_path).resolve()
    if any(resolved.is_relative_to(root.resolve()) for root in roots):
        return None
    return (
        f"{checkpoint_path} is outside the folders the serving service loads checkpoints from "
        f"({', '.join(str(r) for r in roots)}); NEXA_SERVING_CHECKPOINT_ROOTS adds one"
    )
