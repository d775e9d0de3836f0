"""The run's secrets: one bearer token for every service's HTTP routes (and the KV data plane),
and the credentials of the run's Redis.

The launcher creates them once per run directory (`RUN_DIR/secrets.json`, mode 0600; a relaunch on
the same directory keeps them) and hands them to every process it starts through the environment,
never on a command line (`ps` shows argv to every user of a node) nor in `config.json`:

    RELAY_TOKEN            the bearer token services require and internal clients send
    RELAY_REDIS_USERNAME   Redis ACL user, when the run's Redis URL named one
    RELAY_REDIS_PASSWORD   Redis password: the token itself for the Redis the launcher starts
                           (`requirepass`), or the one a user-supplied `redis.url` / `REDIS_URL`
                           carried (stripped from the URL that is written anywhere)

`make status/stop/restart` read the same file (they run as the run's owner).
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

SECRETS_FILE = "secrets.json"
TOKEN_ENV = "RELAY_TOKEN"
REDIS_USERNAME_ENV = "RELAY_REDIS_USERNAME"
REDIS_PASSWORD_ENV = "RELAY_REDIS_PASSWORD"


class AuthError(RuntimeError):
    """The run's secrets are missing or unsafe."""


class RunSecrets(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(min_length=32)
    redis_username: str = ""
    redis_password: str = ""

    def env(self) -> dict[str, str]:
        """What a child process needs: the token, and Redis credentials when there are any."""
        out = {TOKEN_ENV: self.token}
        if self.redis_username:
            out[REDIS_USERNAME_ENV] = self.redis_username
        if self.redis_password:
            out[REDIS_PASSWORD_ENV] = self.redis_password
        return out


def new_token() -> str:
    return secrets.token_urlsafe(32)


def split_redis_url(url: str) -> tuple[str, str, str]:
    """(the URL without credentials, username, password). `redis://:pw@h:6379/0` carries only a
    password; `redis://user:pw@h/0` an ACL user and its password."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url, "", ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    public = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return public, unquote(parts.username or ""), unquote(parts.password or "")


def _write_private(path: Path, text: str) -> None:
    """Create `path` readable by its owner only, whatever the umask (never 0644 for a moment)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_run_secrets(run_dir: str | Path) -> RunSecrets:
    path = Path(run_dir) / SECRETS_FILE
    try:
        st = path.stat()
    except FileNotFoundError:
        raise AuthError(f"{path}: no run secrets (the launcher writes them)") from None
    if st.st_mode & 0o077:
        raise AuthError(
            f"{path}: mode {st.st_mode & 0o777:o} lets other users read the run's secrets; chmod 600 it"
        )
    return RunSecrets.model_validate_json(path.read_text())


def ensure_run_secrets(run_dir: str | Path, redis_url: str = "") -> tuple[RunSecrets, str]:
    """The run's secrets (created on first launch, kept by a relaunch on the same directory) and
    the Redis URL to write anywhere, without credentials. A `redis_url` that carries credentials
    sets the Redis ones; with no URL (the launcher starts Redis) the password is the token."""
    path = Path(run_dir) / SECRETS_FILE
    public, user, password = split_redis_url(redis_url)
    old = load_run_secrets(run_dir) if path.exists() else None
    token = old.token if old is not None else new_token()
    if not redis_url:
        user, password = "", token
    elif not password:
        # A user-supplied Redis whose URL names no credentials: the environment's, else none.
        user = os.environ.get(REDIS_USERNAME_ENV, "")
        password = os.environ.get(REDIS_PASSWORD_ENV, "")
    out = RunSecrets(token=token, redis_username=user, redis_password=password)
    if out != old:
        _write_private(path, out.model_dump_json())
    return out, public


def child_env(base: Mapping[str, str], run: RunSecrets) -> dict[str, str]:
    """`base` (a launcher's environment) with its own relay secrets, if any, replaced by the run's."""
    env = {k: v for k, v in base.items() if k not in (TOKEN_ENV, REDIS_USERNAME_ENV, REDIS_PASSWORD_ENV)}
    return {**env, **run.env()}


def with_credentials(url: str, run: RunSecrets) -> str:
    """`url` carrying the run's Redis credentials, for a launcher's own in-process clients (a URL
    like this is never written to a file or a command line)."""
    public, _user, _password = split_redis_url(url)
    if not run.redis_password:
        return public
    parts = urlsplit(public)
    user = quote(run.redis_username, safe="")
    netloc = f"{user}:{quote(run.redis_password, safe='')}@{parts.netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def standalone_secrets() -> str:
    """For a process that starts services itself, outside a launcher (a benchmark): a token, also
    the password of any Redis it starts, put in its own environment so that what it starts and
    the clients it makes inherit them. Returns the token."""
    token = os.environ.setdefault(TOKEN_ENV, new_token())
    os.environ.setdefault(REDIS_PASSWORD_ENV, token)
    return token


def token_from_env() -> str:
    """This process's run token; services refuse to start without one."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise AuthError(
            f"no run token: set {TOKEN_ENV} (the launcher passes the one in RUN_DIR/{SECRETS_FILE})"
        )
    return token


def redis_credentials(url: str) -> tuple[str | None, str | None]:
    """(username, password) for a connection to `url`: the URL's own, else the environment's."""
    _public, user, password = split_redis_url(url)
    if password:
        return user or None, password
    return os.environ.get(REDIS_USERNAME_ENV) or None, os.environ.get(REDIS_PASSWORD_ENV) or None


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def auth_headers() -> dict[str, str]:
    """What an internal client sends: the run token from the environment."""
    return bearer(token_from_env())


def check_bearer(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (constant-time compare)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
