"""Every HTTP service holds to its OpenAPI document, as schemathesis with all its checks sees it.

Each service runs for real on a free loopback port, one at a time, and schemathesis's own engine
(what ``st run --checks all`` runs: examples, coverage, fuzzing and stateful phases) sends it at
least :data:`MIN_REQUESTS` generated requests built from its ``/openapi.json``. Any failure of any
check fails the test, with schemathesis's account of it and a curl line to reproduce it: a 5xx,
a status the document does not list, a response off its schema, a schema-invalid request
accepted or a schema-valid one refused, a 405 whose ``Allow`` omits a method, a token ignored.

One refusal of a schema-valid request is part of the contract: a response may list under
``x-stargym-beyond-schema`` (services/openapi.py) the error codes it carries for rules no JSON
Schema states, such as an env's own checks of its options. Only those codes, on those responses,
pass the acceptance check.

The fixtures keep expensive routes cheap rather than fewer: a small instance limit on env servers,
a short context and two sequences on the CPU engine. Generation is seeded and
derandomized, so a failure here reproduces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import (
    RunningServer,
    free_port,
    short_run_overrides,
    start_engine,
    start_server,
    stop_server,
)
from dashboard_data import make_run
from schemathesis.config import FuzzConfig, SchemathesisConfig
from schemathesis.core.failures import Failure
from schemathesis.engine import events, from_schema
from schemathesis.engine.core import EventStream
from schemathesis.engine.recorder import ScenarioRecorder
from schemathesis.schemas import BaseSchema

from deploy.model_init import init_tiny_model
from services.openapi import BEYOND_SCHEMA

pytestmark = pytest.mark.timeout(5 * 60)

SEED = 14
MIN_REQUESTS = 1_000
REQUEST_TIMEOUT_S = 20.0
"""Every request's deadline: schemathesis reports a request that does not finish by then."""
MAX_RESPONSE_TIME_S = 10.0
"""schemathesis's max_response_time check: no answer of these services should take longer."""
FUZZ_DEADLINE_S = 60
"""The most the fuzz mode may take to make up MIN_REQUESTS for a small API."""
TOKEN = "contract-test-token"


Part = Callable[[BaseSchema], BaseSchema]
"""The operations of a document to run together (``schema.include``/``exclude``)."""


@dataclass
class Target:
    """A started service and how hard to fuzz it: ``max_examples`` per operation and phase."""

    server: RunningServer
    max_examples: int
    parts: tuple[Part, ...]
    token: str | None = None


REASONING = "env_server.envs.reasoning.hosted"
TEXTARENA = "env_server.envs.textarena.hosted"
ENV_SERVERS = {
    "game": ["game"],
    "embodied": ["embodied"],
    "search": ["search"],
    "web": ["web"],
    # Three of each family's envs: every env of the family is the same class made for another
    # dataset or game, with the same routes; all of them would be hundreds of operations.
    "reasoning": [f"--env={REASONING}:{name}Env" for name in ("CountBits", "BasicArithmetic", "WordSorting")],
    "textarena": [
        f"--env={TEXTARENA}:TextArena{name}Env" for name in ("GuessTheNumber", "Mastermind", "TowerOfHanoi")
    ],
}
MAX_INSTANCES = 8
"""Creates past it are a cheap 429 (the stateful phase closes instances as well as opening them)."""


def env_server(name: str, tmp_path: Path) -> RunningServer:
    port = free_port()
    args = ["env", "serve", *ENV_SERVERS[name], "--port", str(port), "--max-instances", str(MAX_INSTANCES)]
    return start_server(args, port, tmp_path, name=name)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("contract-model") / "policy-v0", 0, ["game"], 20, 20)


@pytest.fixture(scope="module")
def engine(tiny_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The CPU engine with a short context and two sequences: no generation takes long."""
    flags = ["--threads", "1", "--max-num-seqs", "2", "--max-model-len", "96", "--served-model-name", "tiny"]
    server = start_engine(tiny_policy, tmp_path_factory.mktemp("contract-engine"), *flags)
    yield server
    stop_server(server.process)


def worker(engine: RunningServer, tiny_policy: Path, redis_url: str, tmp_path: Path) -> RunningServer:
    port = free_port()
    args = ["rollout", "--engine-url", engine.url, "--tokenizer", str(tiny_policy), "--port", str(port)]
    args += ["--run", "contract", "--env", f"game=http://127.0.0.1:{free_port()}"]
    return start_server(args, port, tmp_path, env={"REDIS_URL": redis_url}, name="worker")


def trainer(redis_url: str, tmp_path: Path) -> RunningServer:
    """A trainer waiting for trajectories nobody sends: its /status and live dashboard stay up."""
    port = free_port()
    config = Path(__file__).resolve().parents[2] / "configs/frozenlake-tiny.yaml"
    args = ["train", str(config), "--port", str(port), "--threads", "1"]
    for item in [
        *short_run_overrides(tmp_path, "contract"),
        f"envs.servers.game=http://127.0.0.1:{free_port()}",
    ]:
        args += ["--set", item]
    return start_server(args, port, tmp_path, env={"REDIS_URL": redis_url}, name="trainer")


def dashboard(tmp_path: Path) -> RunningServer:
    """``stargym dashboard`` over two runs, behind an API token."""
    make_run(tmp_path / "runs", "long", steps=300)
    make_run(tmp_path / "runs", "short", steps=5)
    port = free_port()
    env = {"REDIS_URL": "", "STARGYM_API_TOKEN": TOKEN}
    return start_server(
        ["dashboard", str(tmp_path / "runs"), "--port", str(port)], port, tmp_path, env=env, name="dashboard"
    )


SERVICES = [*ENV_SERVERS, "engine", "rollout", "trainer", "dashboard"]
MAX_EXAMPLES = {
    "game": 12,
    "embodied": 10,
    "web": 20,
    "search": 18,
    "reasoning": 10,
    "textarena": 10,
    "dashboard": 60,
}
PARTS: dict[str, tuple[Part, ...]] = {
    # Paused, the engine holds every new generation until /resume (vLLM's semantics), so a
    # generation sent then would wait out its deadline: /pause runs apart, with /resume.
    "engine": (
        lambda schema: schema.exclude(path="/pause"),
        lambda schema: schema.include(path=["/pause", "/resume", "/is_paused"]),
    ),
}
"""Services whose operations schemathesis runs in separate parts, one after the other."""


@pytest.fixture(params=SERVICES)
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    name = request.param
    tmp_path = tmp_path_factory.mktemp(name)
    if name in ENV_SERVERS:
        server = env_server(name, tmp_path)
    elif name == "engine":
        server = request.getfixturevalue("engine")
    elif name == "rollout":
        engine_server = request.getfixturevalue("engine")
        policy = request.getfixturevalue("tiny_policy")
        server = worker(engine_server, policy, request.getfixturevalue("redis_url"), tmp_path)
    elif name == "trainer":
        server = trainer(request.getfixturevalue("redis_url"), tmp_path)
    else:
        server = dashboard(tmp_path)
    token = TOKEN if name == "dashboard" else None
    yield Target(server, MAX_EXAMPLES.get(name, 25), PARTS.get(name, (lambda schema: schema,)), token)
    if name == "engine":  # module-scoped, and the rollout worker's test needs it serving
        httpx.post(f"{server.url}/resume", timeout=REQUEST_TIMEOUT_S).raise_for_status()
    else:
        stop_server(server.process)


def contract_config(target: Target) -> SchemathesisConfig:
    settings: dict[str, Any] = {
        "seed": SEED,
        "workers": 1,
        "continue-on-failure": True,
        "request-timeout": REQUEST_TIMEOUT_S,
        "checks": {"enabled": True, "max_response_time": MAX_RESPONSE_TIME_S},
        "generation": {"max-examples": target.max_examples, "deterministic": True, "database": "none"},
    }
    if target.token is not None:
        settings["auth"] = {"openapi": {"bearer": {"bearer": target.token}}}
    return SchemathesisConfig.from_dict(settings)


@dataclass
class Outcome:
    """What schemathesis sent and what failed: one account of each kind of failure per operation."""

    requests: int = 0
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seen: set[tuple[str, str, str]] = field(default_factory=set)

    def record(self, recorder: ScenarioRecorder) -> None:
        self.requests += len(recorder.interactions)
        for checks in recorder.checks.values():
            for check in checks:
                info = check.failure_info
                key = (recorder.label, check.name, info.failure.title) if info is not None else None
                if info is not None and key not in self.seen:
                    self.seen.add(key)
                    self.failures.append(f"{recorder.label}: {info.failure}\n{info.code_sample}")

    def read(self, stream: EventStream, enough: int | None = None) -> None:
        """Record ``stream``'s events; with ``enough``, stop it once that many requests were sent."""
        for event in stream:
            if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
                self.record(event.recorder)
                if enough is not None and self.requests >= enough:
                    stream.stop()
            elif isinstance(event, events.NonFatalError):
                self.errors.append(f"{event.label}: {event.info.format()}")
            elif isinstance(event, events.FatalError):
                self.errors.append(f"fatal: {event.exception!r}")


def run_schemathesis(target: Target) -> Outcome:
    """Every phase of schemathesis against the target's document, part by part, then, for an API
    too small to make :data:`MIN_REQUESTS` of them, its fuzz mode (random calls, valid and not)."""
    url = f"{target.server.url}/openapi.json"
    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    schema = schemathesis.openapi.from_url(
        url, config=contract_config(target), timeout=REQUEST_TIMEOUT_S, headers=headers
    )
    schema.hook("filter_failure")(_not_a_documented_refusal)
    outcome = Outcome()
    for part in target.parts:
        outcome.read(from_schema(part(schema)).execute())
    if outcome.requests < MIN_REQUESTS:  # over the first part: most targets have one, the whole document
        fuzzing = from_schema(target.parts[0](schema)).fuzz(FuzzConfig(max_time=FUZZ_DEADLINE_S))
        outcome.read(fuzzing, enough=MIN_REQUESTS)
    return outcome


def _not_a_documented_refusal(_: Any, failure: Failure, case: Any, response: Any) -> bool:
    """False (drop the failure) for a schema-valid request refused by a rule beyond the schema
    that the operation's response lists: the status and its error code under BEYOND_SCHEMA."""
    if "positive_data_acceptance" not in failure.checks:
        return True
    documented = case.operation.definition.raw.get("responses", {}).get(str(response.status_code), {})
    try:
        code = json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return True
    return code not in documented.get(BEYOND_SCHEMA, ())


def test_the_service_holds_to_its_openapi_document(target: Target) -> None:
    outcome = run_schemathesis(target)
    print(f"{target.server.name}: {outcome.requests} requests")  # shown by pytest -rP
    report = "\n\n".join(outcome.errors + outcome.failures)
    assert not outcome.failures and not outcome.errors, (
        f"{len(outcome.failures)} failures, {len(outcome.errors)} errors in {outcome.requests} requests:\n\n"
        f"{report}"
    )
    assert outcome.requests >= MIN_REQUESTS, f"only {outcome.requests} requests were sent"
