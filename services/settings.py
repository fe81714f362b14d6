"""Settings shared by every service, read from ``STARGYM_*`` environment variables.

Each service subclasses :class:`ServiceSettings`; a field ``foo`` is set by ``STARGYM_FOO``.
Command-line flags override the environment by passing keyword arguments.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

ONE_MIB = 1024 * 1024


class ServiceSettings(BaseSettings):
    """What every HTTP service needs: where to listen, how big a request may be, who may call."""

    model_config = SettingsConfigDict(env_prefix="STARGYM_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    api_token: SecretStr | None = Field(
        default=None,
        description="When set, every route but /health and /login needs it: an 'Authorization: Bearer' "
        "header, or the cookie a browser gets by signing in (services/http_app.py, TokenAuth).",
    )
    max_body_bytes: int = Field(default=ONE_MIB, gt=0, description="Larger request bodies get 413.")
    log_level: str = "warning"


class EnvServerSettings(ServiceSettings):
    """The env host: how many instances it keeps and how long an idle one lives."""

    port: int = 8101
    max_instances: int = Field(default=4096, gt=0, description="Creates past this get 429.")
    instance_ttl_s: float = Field(
        default=900.0, gt=0, description="Idle instances older than this are reaped."
    )
    reaper_interval_s: float = Field(default=30.0, gt=0, description="How often the reaper looks.")
