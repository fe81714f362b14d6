"""docker-compose.yml and the Dockerfiles, checked without a container runtime.

The compose file is validated against the Compose Specification, then read as compose reads it
(YAML merge keys resolved, ``${VAR:-default}`` interpolated with the defaults and with a .env of
chosen values) and checked for what a schema cannot see: each stargym service's command parses as a
``stargym`` command on the port services.contracts gives it, its ``STARGYM_*`` variables are settings
it reads, every URL it is given names a service of its stack listening there, the workers and the
trainers know every env server, health checks and dependencies line up, and only the dashboard and the
env servers are published. Java goes into the embodied env server's image only, with its JVMs' heap
capped below the container's memory; the search and web env servers keep their indexes on volumes of
their own.
.env.example must document exactly the variables the file reads.
The Dockerfiles pass hadolint.
``tests/e2e/test_compose.py`` brings the cpu profile up for real.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from cli_checks import (
    REPO_ROOT,
    SUBCOMMAND_SETTINGS,
    embodied_memory_mib,
    load_service_settings,
    load_settings,
    parse_stargym,
    served_port,
    train_config,
)

from deploy import healthcheck
from env_server.envs.search.facts import cache_root
from rollout_server.engine.settings import EngineSettings
from rollout_server.settings import WorkerSettings, parse_engine_urls
from services.contracts import FAMILY_PORTS, ROLLOUT_PORT, TRAINER_PORT, parse_env_servers

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENV_FILE = REPO_ROOT / ".env"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
REDIS_DOCKERFILE = REPO_ROOT / "tests" / "e2e" / "compose_redis.Dockerfile"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"
HADOLINT = Path(sys.executable).parent / "hadolint"
STARGYM_UID = 10001  # the Kubernetes manifests' runAsUser and the owner of the data volume

# Which services run with which profile (none: with either stack).
PROFILES = {
    "redis": set(),
    "env-game": set(),
    "env-embodied": set(),
    "env-search": set(),
    "env-web": set(),
    "env-reasoning": set(),
    "env-textarena": set(),
    "vllm": {"gpu"},
    "rollout": {"gpu"},
    "trainer": {"gpu"},
    "engine": {"cpu"},
    "rollout-cpu": {"cpu"},
    "trainer-cpu": {"cpu"},
}
PUBLISHED = {
    "env-game": "STARGYM_ENV_GAME_PORT",
    "env-embodied": "STARGYM_ENV_EMBODIED_PORT",
    "env-search": "STARGYM_ENV_SEARCH_PORT",
    "env-web": "STARGYM_ENV_WEB_PORT",
    "env-reasoning": "STARGYM_ENV_REASONING_PORT",
    "env-textarena": "STARGYM_ENV_TEXTARENA_PORT",
    "trainer": "STARGYM_DASHBOARD_PORT",
}
PUBLISHED["trainer-cpu"] = PUBLISHED["trainer"]

# A .env a user might write: every value differs from the default, and the stacks still fit together.
CUSTOM_DOTENV = """\
COMPOSE_PROFILES=gpu
STARGYM_IMAGE=registry.example.com/team/stargym
STARGYM_IMAGE_TAG=0.1
STARGYM_BIND_ADDRESS=0.0.0.0
STARGYM_ENV_GAME_PORT=9101
STARGYM_ENV_EMBODIED_PORT=9102
STARGYM_ENV_SEARCH_PORT=9103
STARGYM_ENV_WEB_PORT=9104
STARGYM_ENV_REASONING_PORT=9105
STARGYM_ENV_TEXTARENA_PORT=9106
STARGYM_SCIWORLD_POOL_SIZE=8
STARGYM_ENV_EMBODIED_MEMORY=6g
STARGYM_DASHBOARD_PORT=9300
STARGYM_MODEL_DIR=/srv/models/Qwen2.5-7B-Instruct
STARGYM_GPU_CONFIG=configs/textcraft-qwen2.5-7b-gpu.yaml
STARGYM_VLLM_MAX_MODEL_LEN=16384
STARGYM_TRAINER_GPUS=1,2
STARGYM_TRAINER_NPROC=2
STARGYM_CPU_CONFIG=configs/bandit-tiny.yaml
STARGYM_CPU_MODEL=models/tiny-bandit
STARGYM_ROLLOUT_CONCURRENCY=16
STARGYM_RUN=textcraft-7b
STARGYM_API_TOKEN=s3cret-token
"""


# -- reading the compose file as compose does --------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_]\w*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?-)(?P<default>.*))?", re.DOTALL)


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as compose reads a .env file (ours use no quotes and no inline comments)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and key not in values, f"{path.name}: {line!r} is not a new KEY=VALUE"
        values[key] = value
    return values


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$``.

    Any other form (``${VAR:?error}``, ``${VAR:+alt}``) fails: this reader would get it wrong.
    """

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return variables.get(match["named"], "")
        braced = _BRACED.fullmatch(match["braced"])
        assert braced, f"${{{match['braced']}}}: a form of interpolation this test does not read"
        value = variables.get(braced["name"])
        if (braced["op"] == ":-" and not value) or (braced["op"] == "-" and value is None):
            return braced["default"]
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolated_variables(data: Any) -> dict[str, set[str]]:
    """Each variable the compose data reads → the defaults it is given (``""`` for none)."""
    found: dict[str, set[str]] = {}
    for text in strings(data):
        for match in _VARIABLE.finditer(text):
            braced = _BRACED.fullmatch(match["braced"] or "")
            name = match["named"] or (braced["name"] if braced else None)
            if name:
                found.setdefault(name, set()).add((braced["default"] or "") if braced else "")
    return found


def strings(data: Any) -> Iterator[str]:
    if isinstance(data, dict):
        for value in data.values():
            yield from strings(value)
    elif isinstance(data, list):
        for value in data:
            yield from strings(value)
    elif isinstance(data, str):
        yield data


def substitute(data: Any, variables: dict[str, str]) -> Any:
    if isinstance(data, dict):
        return {key: substitute(value, variables) for key, value in data.items()}
    if isinstance(data, list):
        return [substitute(value, variables) for value in data]
    return interpolate(data, variables) if isinstance(data, str) else data


def raw_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The file as YAML: anchors and ``<<`` merge keys resolved, nothing interpolated."""
    return yaml.safe_load(path.read_text())


def load_compose(variables: dict[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    return substitute(raw_compose(path), variables)


@pytest.fixture(params=["defaults", "custom .env"])
def variables(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """No variables set (the file's defaults), or those of a user's .env (:data:`CUSTOM_DOTENV`)."""
    if request.param == "defaults":
        return {}
    dotenv = tmp_path / ".env"
    dotenv.write_text(CUSTOM_DOTENV)
    return read_env_file(dotenv)


# -- what a service runs -----------------------------------------------------------------------------


def is_stargym(service: dict[str, Any]) -> bool:
    return service.get("build", {}).get("dockerfile") == "deploy/docker/Dockerfile"


def stargym_services(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, service in config["services"].items():
        if is_stargym(service):
            yield name, service


def image_name(service: dict[str, Any]) -> str:
    """``registry/team/redis:7.4`` → ``redis``."""
    return service["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]


def command(service: dict[str, Any]) -> list[str]:
    args = service.get("command", [])
    return shlex.split(args) if isinstance(args, str) else [str(arg) for arg in args]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in ``args``."""
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def role(service: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A stargym service's subcommand and its parsed parameters."""
    return parse_stargym(command(service))


def listening_port(config: dict[str, Any], name: str) -> int:
    """The port the service's command makes it listen on."""
    service = config["services"][name]
    if is_stargym(service):
        path, params = role(service)
        return params["port"] or served_port(path, params)
    defaults = {"vllm-openai": 8000, "redis": 6379}
    assert image_name(service) in defaults, f"{name}: which port does {service['image']} listen on?"
    return int(flag_value(command(service), "--port") or defaults[image_name(service)])


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def container_environment(service: dict[str, Any]) -> dict[str, str]:
    """What a stargym container's process sees: the image's ENV, then the service's ``environment``."""
    return image_env() | environment(service)


def profiles(service: dict[str, Any]) -> set[str]:
    return set(service.get("profiles", []))


def active(config: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The services ``docker compose --profile PROFILE up`` starts."""
    return {name: s for name, s in config["services"].items() if not profiles(s) or profile in profiles(s)}


def volume_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Target → (source, read-only) of the service's short-syntax volumes."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target, *mode = entry.split(":")
        mounts[target] = (source, mode == ["ro"])
    return mounts


def published_ports(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each ``ports`` entry; an address is required."""
    found = []
    for entry in service.get("ports", []):
        parts = str(entry).rsplit(":", 2)
        assert len(parts) == 3, f"{entry!r} is published on every interface: name the address"
        found.append((parts[0], parts[1], parts[2]))
    return found


def duration_s(text: str) -> float:
    """A compose duration (``5s``, ``1m30s``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"{text!r} is not a duration"
    return sum(float(number) * units[unit] for number, unit in parts)


# -- the Dockerfiles ---------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments dropped."""
    found = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        keyword, _, arguments = (current + line).partition(" ")
        found.append((keyword.upper(), arguments.strip()))
        current = ""
    return found


def final_stage(path: Path) -> list[tuple[str, str]]:
    found = instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(found) if keyword == "FROM")
    return found[last_from:]


def image_env() -> dict[str, str]:
    """The ENV of the stargym image."""
    env: dict[str, str] = {}
    for keyword, arguments in final_stage(DOCKERFILE):
        if keyword == "ENV":
            env |= dict(item.split("=", 1) for item in shlex.split(arguments))
    return env


# -- the tests: the file as a whole -----------------------------------------------------------------


def check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_compose_file_follows_the_compose_specification() -> None:
    result = check_jsonschema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_specification_check_rejects_an_unknown_key(tmp_path: Path) -> None:
    text = COMPOSE_FILE.read_text()
    assert "    healthcheck:\n" in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace("    healthcheck:\n", "    healthchek:\n", 1))
    result = check_jsonschema(broken)
    assert result.returncode == 1 and "healthchek" in result.stdout, result.stdout + result.stderr


def test_env_example_documents_exactly_the_variables_the_file_reads() -> None:
    used = interpolated_variables(raw_compose())
    for name, defaults in used.items():
        assert len(defaults) == 1, f"{name} has different defaults in docker-compose.yml: {defaults}"
    example = read_env_file(ENV_EXAMPLE)
    assert next(iter(example)) == "COMPOSE_PROFILES" and example["COMPOSE_PROFILES"] == "gpu"
    assert set(example) - {"COMPOSE_PROFILES"} == set(used), (
        f"only in .env.example: {sorted(set(example) - set(used) - {'COMPOSE_PROFILES'})}; "
        f"only in docker-compose.yml: {sorted(set(used) - set(example))}"
    )
    for name, (default,) in used.items():
        assert example[name] == default, (
            f".env.example: {name}={example[name]}, the file's default {default!r}"
        )
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("# "), f".env.example: {line!r} has no comment above it"


def test_dotenv_starts_the_gpu_stack() -> None:
    assert read_env_file(ENV_FILE) == {"COMPOSE_PROFILES": "gpu"}


def test_the_interpolation_reads_defaults_and_values_as_compose_does() -> None:
    values = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET} $SET $$SET", values) == (
        "x d  d  x $SET"
    )
    with pytest.raises(AssertionError, match="does not read"):
        interpolate("${SET:?required}", values)


def test_the_settings_check_rejects_unknown_and_overridden_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match="STARGYM_ROLLOUT_CONCURENCY is not a setting of WorkerSettings"):
        load_settings(WorkerSettings, {"STARGYM_ROLLOUT_CONCURENCY": "8"}, monkeypatch)
    with pytest.raises(AssertionError, match="STARGYM_API_TOKEN='a' set api_token"):
        load_settings(
            WorkerSettings, {"STARGYM_API_TOKEN": "a", "STARGYM_ROLLOUT_API_TOKEN": "b"}, monkeypatch
        )
    settings = load_settings(
        WorkerSettings, {"STARGYM_ROLLOUT_CONCURRENCY": "8", "PATH": "/bin"}, monkeypatch
    )
    assert isinstance(settings, WorkerSettings) and settings.concurrency == 8


def test_each_profile_runs_one_stack(variables: dict[str, str]) -> None:
    config = load_compose(variables)
    services = config["services"]
    assert {name: profiles(service) for name, service in services.items()} == PROFILES
    gpu_users = {
        name
        for name, service in services.items()
        for device in service.get("deploy", {})
        .get("resources", {})
        .get("reservations", {})
        .get("devices", [])
        if "gpu" in device.get("capabilities", [])
    }
    assert gpu_users == {"vllm", "trainer"}
    for profile, inference in (("gpu", "vllm"), ("cpu", "engine")):
        stack = active(config, profile)
        roles = {role(service)[0] for service in stack.values() if is_stargym(service)}
        assert roles == set(SUBCOMMAND_SETTINGS) - ({("engine", "serve")} if profile == "gpu" else set())
        assert inference in stack and "redis" in stack


# -- the tests: what each service runs -------------------------------------------------------------


def test_stargym_services_run_the_stargym_image(variables: dict[str, str]) -> None:
    config = load_compose(variables)
    image = variables.get("STARGYM_IMAGE", "stargym")
    tag = variables.get("STARGYM_IMAGE_TAG", "latest")
    declared = {
        arguments.split("=", 1)[0] for keyword, arguments in instructions(DOCKERFILE) if keyword == "ARG"
    }
    builds: dict[str, dict[str, Any]] = {}
    for name, service in stargym_services(config):
        assert service["image"] in {f"{image}{flavour}:{tag}" for flavour in ("", "-cuda", "-embodied")}, name
        assert "entrypoint" not in service, f"{name}: the image's entrypoint is `stargym`"
        build = service["build"]
        assert build["context"] == "." and set(build["args"]) <= declared, f"{name}: {build}"
        # Two services building one image name differently would leave whichever built last.
        assert builds.setdefault(service["image"], build) == build, (
            f"{name} builds {service['image']} differently"
        )
    assert len(builds) == 3  # the CPU image, the embodied env server's (with Java) and the GPU trainer's


def served_families(service: dict[str, Any]) -> list[str]:
    """The env families a service serves (none: not an env server)."""
    path, params = role(service)
    return list(params["families"]) if path == ("env", "serve") else []


def test_java_goes_into_the_embodied_env_servers_image_only(variables: dict[str, str]) -> None:
    config = load_compose(variables)
    stage = final_stage(DOCKERFILE)
    assert ("ARG", "WITH_JAVA=false") in stage, "the images without Java are the default"
    (install,) = [args for keyword, args in stage if keyword == "RUN" and "WITH_JAVA" in args]
    assert "openjdk-17-jre-headless" in install and "--no-install-recommends" in install
    for name, service in stargym_services(config):
        java = service["build"]["args"].get("WITH_JAVA", "false")
        assert java == ("true" if "embodied" in served_families(service) else "false"), name


def memory_mib(text: str) -> float:
    """A compose byte value (``4g``, ``512m``, ``1.5gb``; binary multiples) in MiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([bkmg]?)b?", text.lower())
    assert match, f"{text!r} is not a byte value"
    exponent = {"b": 0, "": 0, "k": 1, "m": 2, "g": 3}[match[2]]
    return float(match[1]) * 1024**exponent / 1024**2


def test_the_embodied_env_servers_jvms_fit_its_memory_limit(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = load_compose(variables)["services"]["env-embodied"]
    path, params = role(service)
    _, pool = load_service_settings(path, params, container_environment(service), monkeypatch)
    limit = memory_mib(service["deploy"]["resources"]["limits"]["memory"])
    assert embodied_memory_mib(pool) <= limit, f"{pool} needs more than {limit:.0f} MiB"


def test_the_workers_and_the_trainers_know_every_env_server(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family's server that the workers do not name gets no episodes; one the trainer does not name
    is probed at 127.0.0.1 (nothing there) when a config trains on it."""
    config = load_compose(variables)
    for profile in ("gpu", "cpu"):
        stack = active(config, profile)
        served = {
            family: f"http://{name}:{listening_port(config, name)}"
            for name, service in stack.items()
            if is_stargym(service)
            for family in served_families(service)
        }
        assert set(served) == set(FAMILY_PORTS), profile
        for name, service in stack.items():
            if not is_stargym(service):
                continue
            path, params = role(service)
            if path == ("rollout",):
                with monkeypatch.context() as patch:
                    worker = load_settings(WorkerSettings, container_environment(service), patch)
                assert worker.env_urls == {family: [url] for family, url in served.items()}, name
            if path == ("train",):
                assert train_config(params).envs.servers == served, name


def test_commands_are_stargym_commands_on_the_designed_ports(variables: dict[str, str]) -> None:
    config = load_compose(variables)
    seen = set()
    for name, service in stargym_services(config):
        path, params = role(service)
        seen.add(path)
        assert params["port"] == served_port(path, params), f"{name}: {path} on {params['port']}"
    assert seen == set(SUBCOMMAND_SETTINGS)


def test_stargym_variables_are_settings_the_service_reads(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_compose(variables)
    token = variables.get("STARGYM_API_TOKEN") or None
    for name, service in stargym_services(config):
        path, params = role(service)
        settings, *_ = load_service_settings(path, params, container_environment(service), monkeypatch, name)
        assert settings.host == "0.0.0.0", f"{name} would listen on {settings.host} only"
        tokens = [settings.api_token]
        if isinstance(settings, WorkerSettings):
            tokens += [settings.env_api_token, settings.engine_api_token]
        for got in tokens:
            assert (got and got.get_secret_value()) == token, f"{name}: not the shared API token"
    assert environment(config["services"]["vllm"])["VLLM_API_KEY"] == (token or "")


def test_the_trainers_and_engines_fit_together(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_compose(variables)
    services = config["services"]
    model_dir = variables.get("STARGYM_MODEL_DIR", "./models/policy")

    # GPU: vLLM, the trainer and the rollout worker (the tokenizer) read the model at /model.
    trainer = services["trainer"]
    _, params = role(trainer)
    config_gpu = train_config(params)
    assert config_gpu.model.path == "/model"
    vllm_args = command(services["vllm"])
    assert flag_value(vllm_args, "--model") == "/model"
    for name in ("trainer", "vllm", "rollout"):
        assert volume_mounts(services[name])["/model"] == (model_dir, True), name
    gpus = environment(trainer)["CUDA_VISIBLE_DEVICES"].split(",")
    assert params["nproc_per_node"] == len(gpus), "one trainer process per GPU"
    vllm_len = flag_value(vllm_args, "--max-model-len")  # none: the model's own limit
    if vllm_len is not None:
        assert (config_gpu.rollout.max_model_len or 0) <= int(vllm_len)

    # CPU: the trainer makes the tiny model on the data volume, where the engine serves it from.
    _, params = role(services["trainer-cpu"])
    config_cpu = train_config(params)
    assert config_cpu.model.init_tiny_if_missing
    _, engine = role(services["engine"])
    assert engine["model"] == str(PurePosixPath("/data") / config_cpu.model.path)
    assert (config_cpu.rollout.max_model_len or 0) <= (
        engine["max_model_len"] or EngineSettings().max_model_len
    )
    with monkeypatch.context() as patch:
        worker = load_settings(WorkerSettings, container_environment(services["rollout-cpu"]), patch)
    assert engine["max_num_seqs"] >= worker.concurrency, "the engine refuses part of the worker's episodes"


def test_each_stacks_workers_serve_its_trainers_run(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs, trajectories and the policy are under stargym:<run>:, so a worker of another run
    would leave the trainer waiting: both take STARGYM_RUN."""
    services = load_compose(variables)["services"]
    for trainer, worker in (("trainer", "rollout"), ("trainer-cpu", "rollout-cpu")):
        _, params = role(services[trainer])
        with monkeypatch.context() as patch:
            settings = load_settings(WorkerSettings, container_environment(services[worker]), patch)
        assert settings.run == train_config(params).run.name == variables.get("STARGYM_RUN", "stargym")


def test_every_url_names_a_service_of_the_stack_listening_there(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_compose(variables)
    for profile in ("gpu", "cpu"):
        stack = active(config, profile)
        for name, service in stack.items():
            if not is_stargym(service):
                continue
            path, params = role(service)
            settings, *_ = load_service_settings(path, params, container_environment(service), monkeypatch)
            # The servers it needs from the start (it waits for them to be healthy), then the others.
            needed = [settings.redis_url] if hasattr(settings, "redis_url") else []
            others = []
            if path == ("rollout",):
                engine_urls = params["engine_url"]
                needed += parse_engine_urls(",".join(engine_urls)) if engine_urls else settings.engine_urls
                envs = parse_env_servers(params["env"]) if params["env"] else settings.env_urls
                needed += [url for family_urls in envs.values() for url in family_urls]
            if path == ("train",):  # the env servers of the run, which its dashboard probes
                envs_config = train_config(params).envs
                others += [envs_config.url_for(env.id) for env in envs_config.mix]
                others += list(envs_config.servers.values())
            for url in needed + others:
                parts = urlsplit(url)
                where = f"{profile}: {name} is given {url}"
                assert parts.hostname in stack, f"{where}: no such service in the stack"
                assert parts.port == listening_port(config, parts.hostname), f"{where}: not its port"
            for url in needed:
                dependency = service.get("depends_on", {}).get(urlsplit(url).hostname, {})
                assert dependency.get("condition") == "service_healthy", f"{name} starts before {url}"


def test_the_rollout_workers_advertise_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_compose({})
    workers = [(name, s) for name, s in stargym_services(config) if role(s)[0] == ("rollout",)]
    assert {name for name, _ in workers} == {"rollout", "rollout-cpu"}
    for name, service in workers:
        with monkeypatch.context() as patch:
            settings = load_settings(WorkerSettings, container_environment(service), patch)
        assert settings.advertised_url == f"http://{name}:{ROLLOUT_PORT}"


# -- the tests: health, dependencies, ports, volumes -------------------------------------------------


def test_every_service_checks_its_own_health() -> None:
    config = load_compose({})
    for name, service in config["services"].items():
        check = service["healthcheck"]
        assert not check.get("disable"), name
        if is_stargym(service):
            url = f"http://127.0.0.1:{listening_port(config, name)}/health"
            assert check["test"] == ["CMD", "python", "-m", "deploy.healthcheck", url], name
            # The probe gives up first, so the health log says why rather than "timed out".
            assert duration_s(check["timeout"]) > healthcheck.TIMEOUT_S, name
        elif image_name(service) == "vllm-openai":
            assert check["test"][:2] == ["CMD", "python3"], name
            assert f"'http://127.0.0.1:{listening_port(config, name)}/health'" in check["test"][-1], name
        else:
            assert image_name(service) == "redis"
            assert check["test"] == ["CMD", "redis-cli", "ping"], name


def test_dependencies_wait_for_health_within_the_stack() -> None:
    config = load_compose({})
    services = config["services"]
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: depends_on without conditions only waits for a start"
        for dependency, how in depends_on.items():
            assert dependency in services, f"{name} depends on {dependency}: no such service"
            assert profiles(services[dependency]) <= profiles(service), f"{name}: {dependency} may not run"
            condition = how.get("condition")
            assert condition in {"service_healthy", "service_completed_successfully"}, f"{name}: {how}"
            if condition == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name}: {dependency} has no health check"


def test_only_the_dashboard_and_the_env_servers_are_published(variables: dict[str, str]) -> None:
    config = load_compose(variables)
    address = variables.get("STARGYM_BIND_ADDRESS", "127.0.0.1")
    defaults = {
        "STARGYM_ENV_GAME_PORT": str(FAMILY_PORTS["game"]),
        "STARGYM_ENV_EMBODIED_PORT": str(FAMILY_PORTS["embodied"]),
        "STARGYM_ENV_SEARCH_PORT": str(FAMILY_PORTS["search"]),
        "STARGYM_ENV_WEB_PORT": str(FAMILY_PORTS["web"]),
        "STARGYM_ENV_REASONING_PORT": str(FAMILY_PORTS["reasoning"]),
        "STARGYM_ENV_TEXTARENA_PORT": str(FAMILY_PORTS["textarena"]),
        "STARGYM_DASHBOARD_PORT": str(TRAINER_PORT),
    }
    for name, service in config["services"].items():
        assert "network_mode" not in service, f"{name}: outside the compose network"
        ports = published_ports(service)
        if name not in PUBLISHED:
            assert ports == [], f"{name} is published: {ports}"
            continue
        host_port = variables.get(PUBLISHED[name], defaults[PUBLISHED[name]])
        assert ports == [(address, host_port, str(listening_port(config, name)))], name


def test_vllm_serves_the_reload_routes_on_the_compose_network_only() -> None:
    vllm = load_compose({})["services"]["vllm"]
    args = command(vllm)
    assert image_name(vllm) == "vllm-openai" and vllm["image"].endswith(":v0.32.0")
    for flag, value in (
        ("--model", "/model"),
        ("--served-model-name", "policy"),
        ("--port", "8000"),
        ("--logprobs-mode", "processed_logprobs"),
    ):
        assert flag_value(args, flag) == value, flag
    env = environment(vllm)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "ports" not in vllm and "network_mode" not in vllm


def test_named_volumes_hold_the_data_redis_and_the_search_indexes(
    variables: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_compose(variables)
    declared = set(config["volumes"])
    assert declared == {"data", "redis-data", "search-cache", "web-cache"}
    for name, service in config["services"].items():
        for target, (source, _) in volume_mounts(service).items():
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source} for {target} is not declared"
    for name in ("trainer", "trainer-cpu"):
        assert volume_mounts(config["services"][name])["/data"] == ("data", False), name
    for name in ("vllm", "engine"):  # they load the policies the trainer publishes there, by path
        assert volume_mounts(config["services"][name])["/data"][0] == "data", name
    assert volume_mounts(config["services"]["redis"])["/data"] == ("redis-data", False)
    assert flag_value(command(config["services"]["redis"]), "--appendonly") == "yes"
    # The search server caches its dataset and index, the web server its catalog's index, each on
    # its own volume: a restart does not rebuild. Mounted at the image's /data, which the stargym
    # user owns, so a new volume starts writable.
    for name, volume in (("env-search", "search-cache"), ("env-web", "web-cache")):
        server = config["services"][name]
        assert volume_mounts(server)["/data"] == (volume, False), name
        with monkeypatch.context() as patch:
            patch.setenv("STARGYM_CACHE_DIR", container_environment(server)["STARGYM_CACHE_DIR"])
            assert cache_root().is_relative_to("/data"), name


# -- the tests: the Dockerfiles ----------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REDIS_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REDIS_DOCKERFILE], ids=lambda p: p.name)
def test_the_images_build_on_base_image_and_run_as_a_user(dockerfile: Path) -> None:
    found = instructions(dockerfile)
    assert found[0][0] == "ARG" and found[0][1].startswith("BASE_IMAGE="), "ARG BASE_IMAGE=... comes first"
    # Every stage starts from the base image, directly or through an earlier stage.
    named: set[str] = set()
    froms = [arguments.split() for keyword, arguments in found if keyword == "FROM"]
    for words in froms:
        assert words[0] == "${BASE_IMAGE}" or words[0] in named, f"FROM {words[0]} is not the base image"
        if len(words) == 3 and words[1].upper() == "AS":
            named.add(words[2])
    assert froms
    users = [arguments for keyword, arguments in final_stage(dockerfile) if keyword == "USER"]
    assert users, "the final stage runs as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    if dockerfile == DOCKERFILE:
        stage = final_stage(dockerfile)
        creates = any(
            keyword == "RUN" and re.search(rf"useradd .*--uid {STARGYM_UID} .*\b{user}\b", arguments)
            for keyword, arguments in stage
        )
        assert user == str(STARGYM_UID) or creates, f"USER {user} is not uid {STARGYM_UID}"
        assert ("ENTRYPOINT", '["stargym"]') in stage
