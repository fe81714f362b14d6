"""``STARGYM_API_TOKEN`` set for a whole run: every HTTP service refuses callers without it, and every
client inside the project sends it.

The run is ``deploy.up.bring_up`` with the token in its environment, as a user who exports it and
runs ``stargym up``: the env server, the CPU engine, the rollout worker and the trainer inherit it.
Per service (the env server's own guard is tested at length in ``test_env_api.py``):

* a protected route answers 401 with the JSON error and ``WWW-Authenticate: Bearer`` without a
  token and with a wrong one, 200 with the right one; ``/metrics`` is protected too (Prometheus
  sends the token as a bearer credential);
* ``/health`` needs no token: probes (Kubernetes, compose, the launcher) carry none. What it
  exposes unauthenticated is a service name and version, or the reason it is unhealthy.

And the round trips: the run trains, so the worker's calls to the env server (episodes) and to
the engine (generation, weight reloads) carried the token; the trainer's system view reads the
worker's ``/status``, the env server and the engine with it. On the same stack, as ``stargym up``
starts it: the rollout side runs ``ROLLOUT_NICENESS`` steps below the trainer. All of it twice:
with the engine in the rollout worker's process (``stargym up``'s default) and as a server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import redis
from conftest import REPO_ROOT, RunningServer, free_port, short_run_overrides, wait_until

from deploy.up import ROLLOUT_NICENESS, EnginePlace, Stack, bring_up
from services.rollout_protocol import RunKeys, Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(6 * 60)]

CONFIG = REPO_ROOT / "configs/frozenlake-tiny.yaml"
RUN = "e2e-api-token"
TOKEN = "e2e-s3cret"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 180.0


def get(service: RunningServer, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"{service.url}{path}", headers=headers, timeout=10.0)


@pytest.fixture(scope="module", params=list(EnginePlace), ids=str)
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    """The secured run, trained past two updates (so policies were published and reloaded), with
    the engine in the worker (its routes under the worker's /engine) and as a server of its own.

    Only ``STARGYM_API_TOKEN`` is set, as a user of ``stargym up`` sets it: the worker's own
    outgoing-token variables are cleared, so the launcher must pass the token on to it.
    """
    tmp_path = tmp_path_factory.mktemp("api-token")
    overrides = [
        *short_run_overrides(tmp_path, RUN),
        f"dashboard.port={free_port()}",
        "optim.total_steps=1000",
    ]
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{RunKeys(RUN).prefix}*"):  # left by an earlier session
        client.delete(key)
    client.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STARGYM_API_TOKEN", TOKEN)
        for name in ("STARGYM_ROLLOUT_ENV_API_TOKEN", "STARGYM_ROLLOUT_ENGINE_API_TOKEN"):
            patch.delenv(name, raising=False)
        with bring_up(
            CONFIG, overrides, concurrency=16, redis_url=redis_url, private=True, engine_place=request.param
        ) as started:

            def trained() -> bool:
                answer = get(started.trainer, "/status", BEARER)
                return answer.status_code == 200 and answer.json()["step"] >= 2

            wait_until(
                trained, "two updates of the secured run", DEADLINE_S, interval_s=0.5, logs=started.services
            )
            yield started


def service(stack: Stack, name: str) -> RunningServer:
    (env_server,) = [s for s in stack.services if s.name.startswith("env-")]
    return {"env": env_server, "engine": stack.engine, "worker": stack.worker, "trainer": stack.trainer}[name]


PROTECTED = [
    ("env", "/envs"),
    ("engine", "/v1/models"),
    ("engine", "/weight_info"),
    ("engine", "/metrics"),
    ("worker", "/status"),
    ("worker", "/metrics"),
    ("trainer", "/status"),
    ("trainer", "/api/runs"),
    ("trainer", "/metrics"),
]


@pytest.mark.parametrize(("name", "path"), PROTECTED)
def test_a_protected_route_needs_the_right_token(stack: Stack, name: str, path: str) -> None:
    server = service(stack, name)
    for headers, message in [
        (None, "missing bearer token"),
        ({"Authorization": "Bearer wrong"}, "invalid bearer token"),
        ({"Authorization": TOKEN}, "invalid bearer token"),  # the token without its scheme
    ]:
        refused = get(server, path, headers)
        assert refused.status_code == 401, (headers, refused.text)
        assert refused.json() == {"error": {"code": "unauthorized", "message": message}}
        assert refused.headers["www-authenticate"] == "Bearer"
    assert get(server, path, BEARER).status_code == 200


@pytest.mark.parametrize("name", ["env", "engine", "worker", "trainer"])
def test_health_needs_no_token(stack: Stack, name: str) -> None:
    answer = get(service(stack, name), "/health")
    assert answer.status_code == 200, answer.text


def test_every_call_inside_the_run_carries_the_token(stack: Stack, redis_url: str) -> None:
    """Episodes (worker → env server, worker → engine) succeed, the worker reloaded the trainer's
    policies into the engine (its admin routes), and the trainer's system view read every service."""
    worker = get(stack.worker, "/status", BEARER).json()
    assert worker["jobs_done"] > 0 and worker["jobs_failed"] == 0, worker
    assert worker["reloads"] >= 1 and worker["policy_version"] >= 1, worker
    assert int(get(stack.engine, "/weight_info", BEARER).json()["weight_version"]) >= 1

    client = redis.Redis.from_url(redis_url)
    try:
        found = [
            Trajectory.model_validate_json(f[b"data"]) for _, f in client.xrange(RunKeys(RUN).trajectories)
        ]
    finally:
        client.close()
    assert found and all(t.error is None for t in found), [t.error for t in found if t.error][:3]

    system = get(stack.trainer, "/api/system", BEARER).json()
    assert [(w["url"], w["ok"], w["error"]) for w in system["workers"]] == [(stack.worker.url, True, None)]
    assert [(e["url"], e["ok"], e["error"]) for e in system["engines"]] == [(stack.engine.url, True, None)]
    assert system["env_servers"] and all(e["ok"] for e in system["env_servers"]), system["env_servers"]


def test_the_rollout_side_runs_below_the_trainer(stack: Stack) -> None:
    """The launcher's default: the update is the slower stage of the cycle on a small machine, so
    the env server, the engine and the worker yield the CPU to the trainer (README, Performance)."""

    def priority(name: str) -> int:
        return os.getpriority(os.PRIO_PROCESS, service(stack, name).process.pid)

    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority("trainer") == own
    assert {name: priority(name) for name in ("env", "engine", "worker")} == dict.fromkeys(
        ("env", "engine", "worker"), min(19, own + ROLLOUT_NICENESS)
    )
