"""docker-compose.yml for real: the ``cpu`` profile built and brought up with Podman, a short job
played end to end through the containers, then everything torn down.

There is no Docker engine here; ``podman-compose`` runs the same file (``make test-compose`` runs
``deploy/docker/podman-setup.sh`` first: podman, its config, a local base image). What the test
proves, in the order a user meets it:

* the images build from the compose file's ``build`` sections (cached between runs: podman reuses
  layers whose inputs did not change), the embodied env server's with Java;
* redis, env-game, env-embodied, env-search, env-web, env-reasoning, env-textarena, trainer-cpu,
  engine and rollout-cpu come up healthy. podman 4.3 ignores ``depends_on: condition:
  service_healthy``, so the test brings them up in dependency order and runs each container's own
  health check until it passes;
* env instances are created and stepped through the published env ports: a FrozenLake game, a
  BabyAI level, a ScienceWorld task (a JVM in the container), a SearchQA question (the search
  server's index, built in the container before it listens), a WebShop search (the shop's
  catalog and index, made there too), whose watch page and current page answer as HTML on the
  same published port, a reasoning-gym question answered (one step ends it) and a TextArena
  GuessTheNumber guess (both packages' data ship in the image);
* the trainer issues jobs, the worker plays them against the engine and env containers, and the
  trajectories come back through Redis: at least 3 updates;
* the dashboard answers on its published port and sees the worker over the compose network;
* ``down -v`` leaves no container, volume or network of the project behind.

Without podman the test is skipped, unless ``STARGYM_REQUIRE_COMPOSE=1`` (``make test``) turns the
skip into a failure. The project name is unique per run and the published ports are free ones, so a
user's own stack on 8101/8300 is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import wait_until

from deploy.launcher import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRE_COMPOSE = os.environ.get("STARGYM_REQUIRE_COMPOSE") == "1"
BASE_IMAGE = os.environ.get("STARGYM_TEST_BASE_IMAGE", "localhost/stargym-base:bookworm")
REDIS_IMAGE = "localhost/stargym-test-redis:latest"
REDIS_DOCKERFILE = Path(__file__).with_name("compose_redis.Dockerfile")
PODMAN_COMPOSE = Path(sys.executable).with_name("podman-compose")
BUILD_DEADLINE_S = 30 * 60  # a cold build fetches ~1 GB of wheels; a cached one takes seconds
# pytest-timeout counts the module fixture's image build in the first test: a dependency change
# rebuilds the deps layer (505 s measured), which with the stack's 3 updates overran the suite's 600 s.
pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(BUILD_DEADLINE_S + 10 * 60)]
START_DEADLINE_S = 5 * 60
UPDATES = 3
# A dependency that is not up yet can make a service exit once or twice before its restart policy
# brings it back (podman ignores `condition: service_healthy`); more is a crash loop.
MAX_RESTARTS = 3


def _missing() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (make test-compose installs it)"
    if not PODMAN_COMPOSE.exists():
        return f"{PODMAN_COMPOSE} is missing (make setup installs podman-compose)"
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE]).returncode != 0:
        return f"no base image {BASE_IMAGE} (deploy/docker/podman-setup.sh builds it)"
    return None


@dataclass
class ComposeProject:
    """One ``podman-compose`` project: the repo's compose file under a unique name and free ports."""

    name: str
    env: dict[str, str]
    log_dir: Path

    def compose(self, *args: str, deadline_s: float = 120.0) -> str:
        """Run ``podman-compose --profile cpu -p NAME ARGS``; its output, or a failure that shows it."""
        command = [str(PODMAN_COMPOSE), "--profile", "cpu", "-p", self.name, *args]
        try:
            done = subprocess.run(
                command, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=deadline_s
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{' '.join(args)} took over {deadline_s} s\n{exc.output}") from None
        output = done.stdout + done.stderr
        (self.log_dir / "podman-compose.log").open("a").write(f"$ {' '.join(command)}\n{output}\n")
        assert done.returncode == 0, f"podman-compose {' '.join(args)} failed:\n{output[-6000:]}"
        return output

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def healthy(self, service: str) -> bool:
        """The container's own health check (its compose ``healthcheck``) passes now."""
        probe = subprocess.run(
            ["podman", "healthcheck", "run", self.container(service)], capture_output=True, timeout=30
        )
        return probe.returncode == 0

    def up(self, *services: str) -> None:
        """Start ``services`` and wait until each is healthy (what ``service_healthy`` would do)."""
        self.compose("up", "-d", "--no-build", *services)
        for service in services:
            wait_until(
                lambda service=service: self._running(service) and self.healthy(service),
                f"{service} healthy\n{self.logs(service)}",
                deadline_s=START_DEADLINE_S,
                interval_s=2.0,
            )

    def _running(self, service: str) -> bool:
        """Running now; a container that exited, or keeps failing and being restarted, fails the wait."""
        state, restarts = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Status}} {{.RestartCount}}", self.container(service)],
            capture_output=True,
            text=True,
        ).stdout.split() or ["missing", "0"]
        if state == "exited" or int(restarts) >= MAX_RESTARTS:
            raise AssertionError(f"{service} {state} after {restarts} restarts:\n{self.logs(service)}")
        return state == "running"

    def logs(self, service: str) -> str:
        done = subprocess.run(
            ["podman", "logs", "--tail", "60", self.container(service)], capture_output=True, text=True
        )
        return done.stdout[-4000:] + done.stderr[-4000:]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, volumes and networks still labelled with this project."""
        label = f"label=io.podman.compose.project={self.name}"
        found = {}
        for kind, command in {
            "containers": ["podman", "ps", "-a", "--filter", label, "--format", "{{.Names}}"],
            "volumes": ["podman", "volume", "ls", "--filter", label, "--format", "{{.Name}}"],
            "networks": ["podman", "network", "ls", "--filter", label, "--format", "{{.Name}}"],
        }.items():
            out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
            found[kind] = out.split()
        return found


@pytest.fixture(scope="module")
def project() -> Iterator[ComposeProject]:
    missing = _missing()
    if missing:
        if REQUIRE_COMPOSE:
            pytest.fail(f"STARGYM_REQUIRE_COMPOSE=1 but {missing}", pytrace=False)
        pytest.skip(missing)
    log_dir = REPO_ROOT / "test-output" / "compose"  # kept after the run (gitignored), for CI logs
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "podman-compose.log").unlink(missing_ok=True)
    env = {
        **os.environ,
        "COMPOSE_PROFILES": "cpu",
        "STARGYM_BASE_IMAGE": BASE_IMAGE,
        # PyPI answers here (download.pytorch.org does not); the CPU wheel itself comes from the
        # wheelhouse the Makefile fills, whose +cpu version pip prefers.
        "STARGYM_CPU_TORCH_INDEX_URL": "https://pypi.org/simple",
        "STARGYM_REDIS_IMAGE": REDIS_IMAGE,
        "STARGYM_ENV_GAME_PORT": str(free_port()),
        "STARGYM_ENV_EMBODIED_PORT": str(free_port()),
        "STARGYM_ENV_SEARCH_PORT": str(free_port()),
        "STARGYM_ENV_WEB_PORT": str(free_port()),
        "STARGYM_ENV_REASONING_PORT": str(free_port()),
        "STARGYM_ENV_TEXTARENA_PORT": str(free_port()),
        "STARGYM_DASHBOARD_PORT": str(free_port()),
        "STARGYM_LOG_LEVEL": "info",
    }
    # The official redis image lives on Docker Hub, which is not reachable here: the same Redis 7
    # from Debian, in an image that runs the compose file's `redis-server ...` command unchanged.
    subprocess.run(
        ["podman", "build", "-q", "-t", REDIS_IMAGE, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
         "-f", str(REDIS_DOCKERFILE), str(REDIS_DOCKERFILE.parent)],
        check=True, timeout=BUILD_DEADLINE_S, capture_output=True,
    )  # fmt: skip
    compose = ComposeProject(f"stargym-test-{uuid.uuid4().hex[:8]}", env, log_dir)
    started = time.monotonic()
    # Every other cpu-profile service runs the one `stargym` image: building it through one service
    # builds it for all (podman-compose would build the same image four times in parallel). The
    # embodied image then reuses its layers below Java.
    for service in ("env-game", "env-embodied"):
        compose.compose("build", service, deadline_s=BUILD_DEADLINE_S)
        print(f"compose build {service}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    try:
        yield compose
    finally:
        compose.compose("down", "-v", "-t", "1", deadline_s=300)


@contextlib.contextmanager
def env_instance(
    project: ComposeProject, port_variable: str, create: dict
) -> Iterator[tuple[httpx.Client, str, str]]:
    """An instance created through a published env port, closed on leaving: a client of that port,
    the instance's id and its first observation."""
    env_url = f"http://127.0.0.1:{project.env[port_variable]}"
    # A ScienceWorld create starts a JVM (~3 s) and loads the task (~2 s) on a busy 2-core machine.
    with httpx.Client(base_url=env_url, timeout=60.0) as env:
        created = env.post("/instances", json=create)
        assert created.status_code == 201, created.text
        instance = created.json()["instance_id"]
        yield env, instance, created.json()["observation"]
        assert env.delete(f"/instances/{instance}").status_code in (200, 204)


def take_step(env: httpx.Client, instance: str, action: str) -> dict:
    stepped = env.post(f"/instances/{instance}/step", json={"action": action})
    assert stepped.status_code == 200, stepped.text
    return stepped.json()


def play_one_step(project: ComposeProject, port_variable: str, create: dict, action: str) -> tuple[str, dict]:
    """Create an instance through a published env port, take one action and close it: the first
    observation and the step's result."""
    with env_instance(project, port_variable, create) as (env, instance, first):
        return first, take_step(env, instance, action)


def test_cpu_profile_trains_through_the_containers(project: ComposeProject) -> None:
    started = time.monotonic()
    project.up("redis", "env-game", "env-embodied", "env-search", "env-web", "env-reasoning", "env-textarena")
    play_one_step(project, "STARGYM_ENV_GAME_PORT", {"env": "game/frozenlake", "seed": 3}, "down")
    embodied = "STARGYM_ENV_EMBODIED_PORT"
    first, step = play_one_step(project, embodied, {"env": "embodied/babyai", "seed": 3}, "turn left")
    assert first.startswith("Your goal: go to the red ball") and step["info"]["valid"], (first, step)
    # ScienceWorld's simulator runs in a JVM: this proves the image's Java.
    first, step = play_one_step(project, embodied, {"env": "embodied/sciworld", "seed": 0}, "look around")
    assert first.startswith("Your task is to boil water"), first
    assert "This room is called" in step["observation"], step
    search = {"env": "search/searchqa", "seed": 0}
    first, step = play_one_step(
        project, "STARGYM_ENV_SEARCH_PORT", search, "<search>capital of France</search>"
    )
    assert first.startswith("Question: "), first
    assert step["observation"].startswith("<information>Doc 1(Title: "), step
    # The shop searches its catalog's index; a person watches the agent on the same published port.
    with env_instance(project, "STARGYM_ENV_WEB_PORT", {"env": "web/shop", "seed": 0}) as (web, shop, first):
        assert first.startswith("WebShop [SEP] Instruction: [SEP] "), first
        step = take_step(web, shop, "search[wool socks]")
        assert step["info"]["valid"] and "Wool Socks" in step["observation"], step
        for path, words in (("", f"watching {shop}"), (step["info"]["url"], "results for wool socks")):
            page = web.get(f"/shop/{shop}/{path}")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page
            assert words in page.text, page.text[:2000]
    # One answer ends a reasoning-gym question, right or wrong; a guess (1 to 20) is one turn of
    # TextArena's game. Both packages' data come with the image.
    reasoning = {"env": "reasoning/basic_arithmetic", "seed": 0}
    first, step = play_one_step(project, "STARGYM_ENV_REASONING_PORT", reasoning, "42")
    assert "Calculate" in first and step["done"], (first, step)
    textarena = {"env": "textarena/guess_the_number", "seed": 0}
    first, step = play_one_step(project, "STARGYM_ENV_TEXTARENA_PORT", textarena, "[10]")
    assert "Guess The Number" in first and step["info"]["valid"], (first, step)
    print(f"env servers answered after {time.monotonic() - started:.0f} s", file=sys.stderr)

    project.up("trainer-cpu")  # makes the tiny model the engine serves, then answers /health
    project.up("engine")
    project.up("rollout-cpu")
    print(f"stack healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)

    dashboard = f"http://127.0.0.1:{project.env['STARGYM_DASHBOARD_PORT']}"
    with httpx.Client(base_url=dashboard, timeout=10.0) as client:

        def trained() -> dict | None:
            status = client.get("/status").json()
            assert status["state"] not in ("failed", "stopped"), status
            return status if status["step"] >= UPDATES else None

        try:
            status = wait_until(trained, f"{UPDATES} updates", deadline_s=10 * 60, interval_s=2.0)
        except AssertionError as error:  # the logs as they are when it gave up, not as it began
            services = ("trainer-cpu", "rollout-cpu", "engine")
            status = client.get("/status").json()
            raise AssertionError("\n".join([str(error), str(status), *map(project.logs, services)])) from None
        assert status["counters"]["trajectories_consumed"] >= status["step"], status
        page = client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        runs = client.get("/api/runs").json()
        assert any(run["name"] == status["run"] for run in runs["runs"]), runs
        # The dashboard reaches the worker over the compose network at its advertised URL.

        def worker_seen() -> dict | None:
            response = client.get("/api/system")
            assert response.status_code == 200, response.text
            system = response.json()
            assert system["available"], system
            return system if any(worker["ok"] for worker in system["workers"]) else None

        system = wait_until(
            worker_seen,
            "the rollout worker on the system page",
            deadline_s=60,
            interval_s=2.0,
        )
        worker = next(w for w in system["workers"] if w["ok"])
        assert worker["url"] == "http://rollout-cpu:8200" and worker["jobs_done"] > 0, system
        assert system["redis"]["ok"], system
    (project.log_dir / "status.json").write_text(json.dumps(status, indent=1))
    print(f"{UPDATES} updates after {time.monotonic() - started:.0f} s", file=sys.stderr)


def test_down_leaves_nothing_behind(project: ComposeProject) -> None:
    project.compose("down", "-v", "-t", "1", deadline_s=300)
    assert project.leftovers() == {"containers": [], "volumes": [], "networks": []}
