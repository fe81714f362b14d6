"""Settings shared by every service, read from ``STARGYM_*`` environment variables.

Each service subclasses :class:`ServiceSettings`; a field ``foo`` is set by ``STARGYM_FOO``.
Command-line flags override the environment by passing keyword arguments.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

ONE_MIB = 1024 * 1024


def _empty_is_unset(value: Any) -> Any:
    return None if isinstance(value, str) and not value.strip() else value


OptionalToken = Annotated[SecretStr | None, BeforeValidator(_empty_is_unset)]
"""A bearer token setting where an empty value means "no token": a compose file or a manifest passes
``STARGYM_API_TOKEN=${STARGYM_API_TOKEN:-}`` through whether or not the user set it, and an empty
token would otherwise lock every caller out."""


class ServiceSettings(BaseSettings):
    """What every HTTP service needs: where to listen, how big a request may be, who may call."""

    model_config = SettingsConfigDict(env_prefix="STARGYM_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    api_token: OptionalToken = Field(
        default=None,
        description="When set, every route but /health and /login needs it: an 'Authorization: Bearer' "
        "header, or the cookie a browser gets by signing in (services/http_app.py, TokenAuth).",
    )
    max_body_bytes: int = Field(default=ONE_MIB, gt=0, description="Larger request bodies get 413.")
    log_level: str = "warning"
    launch_id: str | None = Field(
        default=None,
        description="Set by the launcher that started this process, and echoed by /health, so the "
        "launcher knows the answer is its own service's, not another's on a port taken meanwhile.",
    )


class EnvServerSettings(ServiceSettings):
    """The env host: how many instances it keeps and how long an idle one lives."""

    port: int = 8101
    max_instances: int = Field(default=4096, gt=0, description="Creates past this get 429.")
    instance_ttl_s: float = Field(
        default=900.0, gt=0, description="Idle instances older than this are reaped."
    )
    worker_threads: int = Field(
        default=64,
        gt=0,
        description="Threads that run blocking env calls (asyncio's default, cores + 4, let a few "
        "slow JVM steps stall every other thread-run env).",
    )
    reaper_interval_s: float = Field(default=30.0, gt=0, description="How often the reaper looks.")
    step_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A create, reset, step or close of a sandboxed env that takes longer is stopped: its "
        "process is killed and the instance ends with an error naming the timeout.",
    )
    isolate: Literal["untrusted", "all"] = Field(
        default="untrusted",
        description="Which envs run one process per instance: those not declared `trusted`, or all "
        "(to measure what isolation costs, or to distrust an env without editing it).",
    )


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: where a service is may be shown or logged,
    its secret not (``REDIS_URL=redis://:secret@host:6379/0``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
