"""Settings of the rollout worker, read from environment variables and ``stargym rollout`` flags.

Every field ``foo`` is read from ``STARGYM_ROLLOUT_FOO``, so the worker's settings never clash with
another service's variables in a shared environment (``STARGYM_CONCURRENCY`` is not ours). The
fields every service shares (``host``, ``port``, ``api_token``, ``max_body_bytes``,
``log_level``) also read their common ``STARGYM_*`` name, and Redis comes from ``REDIS_URL`` as
everywhere else; the ``STARGYM_ROLLOUT_*`` name wins when both are set. Keyword arguments use the
plain field names.
"""

from __future__ import annotations

import socket
from typing import Annotated, Any

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from services.contracts import ROLLOUT_PORT, parse_env_servers
from services.rollout_protocol import RUN_ID_PATTERN
from services.settings import ONE_MIB, OptionalToken, ServiceSettings

ENV_PREFIX = "STARGYM_ROLLOUT_"
ENGINE_MOUNT = "/engine"
"""Where a worker that runs the engine in its process (``engine_model``) serves its protocol."""
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def _shared(name: str) -> AliasChoices:
    """``STARGYM_ROLLOUT_<NAME>``, else the shared ``STARGYM_<NAME>``."""
    return AliasChoices(ENV_PREFIX + name.upper(), "STARGYM_" + name.upper())


def parse_engine_urls(value: str | list[str]) -> list[str]:
    """``'http://a:8210,http://b:8210'`` (or a list) → the URLs, without trailing slashes."""
    items = value.split(",") if isinstance(value, str) else value
    urls = [item.strip().rstrip("/") for item in items if item and item.strip()]
    if not urls:
        raise ValueError("at least one engine URL is needed")
    return urls


class WorkerSettings(ServiceSettings):
    """The rollout worker: where jobs, engines and env servers are, and how hard to push them."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, populate_by_name=True)

    host: str = Field(default="127.0.0.1", validation_alias=_shared("host"))
    port: int = Field(default=ROLLOUT_PORT, validation_alias=_shared("port"))
    api_token: OptionalToken = Field(
        default=None,
        validation_alias=_shared("api_token"),
        description="When set, every route but /health needs 'Authorization: Bearer <token>'.",
    )
    max_body_bytes: int = Field(default=ONE_MIB, gt=0, validation_alias=_shared("max_body_bytes"))
    log_level: str = Field(default="warning", validation_alias=_shared("log_level"))
    launch_id: str | None = Field(default=None, validation_alias=_shared("launch_id"))
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices(ENV_PREFIX + "REDIS_URL", "REDIS_URL"),
    )
    engine_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8210"],
        description="Inference servers speaking the engine protocol; episodes are spread over them. "
        "A name that resolves to several addresses (a headless Service) is one engine per address.",
    )
    engine_model: str | None = Field(
        default=None,
        description="A model directory: run the CPU engine on it in this worker's process, instead "
        "of the engines of engine_urls (ignored then). Episodes call it without HTTP; its protocol is "
        f"served on this worker's port under {ENGINE_MOUNT} for everyone else (the dashboard, admin "
        "calls). Its other settings come from STARGYM_* as for `stargym engine serve`, and its "
        "max_num_seqs is at least concurrency.",
    )
    env_urls: Annotated[dict[str, list[str]], NoDecode] = Field(
        default_factory=lambda: {"game": ["http://127.0.0.1:8101"]},
        description="Env servers of each env family, 'game=http://a:8101,http://b:8101;search=…': a job "
        "for 'game/frozenlake' goes to the 'game' server with the fewest episodes in flight. A name "
        "that resolves to several addresses (a headless Service, compose --scale) is one server per "
        "address.",
    )
    resolve_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="How often the env server and engine names are resolved again, so that replicas "
        "added or removed are used or left within this time. 10 s: a new replica starts taking episodes "
        "10 s after it turns ready at worst, which is little next to an engine's start-up (a minute for "
        "vLLM); a removed one's few episodes meanwhile fail and are rerun elsewhere; one lookup per "
        "name per interval costs nothing; and Kubernetes' CoreDNS answers Service records with a 5 s "
        "TTL, so looking more often would mostly read its cache.",
    )
    tokenizer: str | None = Field(
        default=None,
        description="Directory of the tokenizer and chat template of the served policy; "
        "None: engine_model, or the model directory the engine reports (GET /v1/models 'root').",
    )
    run: str = Field(
        default="run",
        pattern=RUN_ID_PATTERN,
        description="The run served: its jobs, trajectories and policy are under stargym:<run>: in "
        "Redis; the trainer's run.name (whose default is also 'run').",
    )
    concurrency: int = Field(default=64, gt=0)
    consumer: str | None = Field(
        default=None,
        description="Consumer name in the 'rollout' group; default: host, pid and a random suffix.",
    )
    visibility_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A job pending this long without a touch is taken over from its (dead) worker.",
    )
    touch_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="How often in-flight jobs are touched; default a third of the visibility timeout.",
    )
    reclaim_interval_s: float = Field(default=5.0, gt=0)
    max_deliveries: int = Field(
        default=3,
        ge=1,
        description="A job reclaimed after this many deliveries (each worker that took it died) is "
        "dead-lettered to stargym:<run>:jobs:dead instead of killing another worker.",
    )
    block_ms: int = Field(
        default=1000,
        gt=0,
        lt=10_000,
        description="Longest XREADGROUP wait.",
    )
    env_retries: int = Field(
        default=1,
        ge=0,
        description="Reruns of an episode after an env error, each on another env server of the "
        "family while there is one it has not failed on.",
    )
    env_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest wait for one env server call (create, step, close): a server that "
        "hangs fails the attempt, which is rerun, instead of holding the episode for ever.",
    )
    agent_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Longest an agent (an 'agent' job's function or outside harness) may take over one "
        "episode; past it the episode is published with an error naming the agent.",
    )
    engine_backoff_s: float = Field(default=0.2, gt=0)
    engine_max_backoff_s: float = Field(default=5.0, gt=0)
    engine_busy_timeout_s: float = Field(
        default=120.0,
        ge=0,
        description="How long the engine client backs off and retries a generation refused with 429.",
    )
    engine_retries: int = Field(
        default=2,
        ge=0,
        description="Reruns of an episode after an engine error (unreachable, 5xx, overloaded too long).",
    )
    redis_backoff_s: float = Field(default=0.5, gt=0)
    redis_max_backoff_s: float = Field(default=10.0, gt=0)
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM, how long in-flight episodes may finish; the rest stay pending for others.",
    )
    policy_poll_s: float = Field(default=5.0, gt=0)
    reload_retry_s: float = Field(
        default=10.0,
        gt=0,
        description="Wait before retrying a failed reload.",
    )
    initial_policy_version: int = Field(
        default=0,
        ge=0,
        description="Version of an engine whose /weight_info is not a number (weights it started with).",
    )
    rate_window_s: float = Field(
        default=60.0,
        gt=0,
        description="Window of episodes/s, tokens/s.",
    )
    heartbeat_s: float = Field(
        default=2.0,
        gt=0,
        description="How often the worker rewrites its entry in the run's workers registry.",
    )
    advertise_url: str | None = Field(
        default=None,
        description="This worker's HTTP base URL as others reach it, put in the registry for the "
        "dashboard; default: http://HOST:PORT, with the machine's hostname for a wildcard HOST "
        "(0.0.0.0, ::). Set it when that name does not resolve for the dashboard (e.g. "
        "http://rollout:8200 for a compose service named 'rollout').",
    )
    env_api_token: OptionalToken = Field(default=None, description="Bearer token of the env servers.")
    engine_api_token: OptionalToken = Field(default=None, description="Bearer token of the engines.")

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _engine_urls(cls, value: Any) -> list[str]:
        return parse_engine_urls(value)

    @field_validator("env_urls", mode="before")
    @classmethod
    def _env_urls(cls, value: Any) -> dict[str, list[str]]:
        return parse_env_servers(value)

    @model_validator(mode="after")
    def _touch_before_timeout(self) -> WorkerSettings:
        if self.touch_interval_s is not None and self.touch_interval_s >= self.visibility_timeout_s:
            raise ValueError("touch_interval_s must be below visibility_timeout_s, or jobs get reclaimed")
        return self

    @property
    def advertised_url(self) -> str:
        """``advertise_url``, else ``http://HOST:PORT`` with a wildcard host replaced by the hostname.

        A worker listening on 127.0.0.1 (``stargym up``) is reached there by a dashboard on the same
        machine; one listening on every interface (a container) is reached by its hostname, which a
        compose network resolves to the container.
        """
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = socket.gethostname() if self.host in _WILDCARD_HOSTS else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def engine_endpoints(self) -> list[str]:
        """The engines episodes go to: this worker's own under :data:`ENGINE_MOUNT` when it runs one
        (``engine_model``), else ``engine_urls``."""
        if self.engine_model is not None:
            return [self.advertised_url + ENGINE_MOUNT]
        return self.engine_urls

    @property
    def local_url(self) -> str:
        """How a client inside this process reaches the worker: loopback when it listens on every
        interface (an agent run by the worker calls its session there)."""
        host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def touch_every_s(self) -> float:
        return self.touch_interval_s if self.touch_interval_s is not None else self.visibility_timeout_s / 3
