"""The CPU engine as a real server: vLLM's protocol, exact log-probs, batching, reload, limits."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import torch
from conftest import RunningServer, free_port, start_server, stop_server, wait_until
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.model_init import init_tiny_model

EPISODES = 20
TEMPERATURE = 0.7
TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny policy and a second checkpoint of it (other seed, same tokenizer)."""
    root = tmp_path_factory.mktemp("engine-models")
    first = init_tiny_model(root / "policy-v0", 0, ["game"], EPISODES, 20)
    second = init_tiny_model(root / "policy-v1", 1, ["game"], EPISODES, 20)
    return first, second


def serve(model: Path, tmp_path: Path, *extra: str) -> RunningServer:
    port = free_port()
    args = [
        "engine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        *extra,
    ]
    return start_server(args, port, tmp_path, name="engine")


@pytest.fixture(scope="module")
def engine(
    checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    server = serve(checkpoints[0], tmp_path_factory.mktemp("engine"))
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def prompt(checkpoints: tuple[Path, Path]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[0])
    messages = [{"role": "user", "content": "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\nReach G and avoid O."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def complete(url: str, prompt: list[int], **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": TEMPERATURE, "top_p": 1.0}
    body |= {"logprobs": 0, "return_token_ids": True, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def reference_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax(logits / T) of each sampled token, from a fresh forward pass of transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return [logprobs[len(prompt) - 1 + index, token].item() for index, token in enumerate(tokens)]


def test_models_lists_the_served_name(engine: RunningServer) -> None:
    body = httpx.get(f"{engine.url}/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == 2048


def test_completion_has_vllm_shape_and_exact_logprobs(
    engine: RunningServer, checkpoints: tuple[Path, Path], prompt: list[int]
) -> None:
    body = complete(engine.url, prompt, seed=1, ignore_eos=True)
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    tokens = choice["token_ids"]
    assert len(tokens) == 24 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["prompt_token_ids"] == prompt
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == len(logprobs["top_logprobs"]) == 24
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 24,
        "total_tokens": len(prompt) + 24,
        "prompt_tokens_details": None,
    }
    expected = reference_logprobs(checkpoints[0], prompt, tokens)
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert choice["text"] == AutoTokenizer.from_pretrained(checkpoints[0]).decode(
        tokens, skip_special_tokens=True
    )


def test_same_seed_same_tokens(engine: RunningServer, prompt: list[int]) -> None:
    first = complete(engine.url, prompt, seed=7)["choices"][0]
    again = complete(engine.url, prompt, seed=7)["choices"][0]
    other = complete(engine.url, prompt, seed=8)["choices"][0]
    assert first["token_ids"] == again["token_ids"]
    # The second reuses the first's KV from the prefix cache: equal to float32 rounding, not bit for bit.
    assert again["logprobs"]["token_logprobs"] == pytest.approx(first["logprobs"]["token_logprobs"], abs=1e-5)
    assert other["token_ids"] != first["token_ids"]


def test_fast_and_routed_completions_answer_alike(engine: RunningServer, prompt: list[int]) -> None:
    """A plain JSON completion is answered without FastAPI's request machinery (``CompletionRoute``),
    one whose content type is another JSON type (``+json``, which FastAPI reads as JSON) by the
    route: the same body, but for the response's id and time, and the same refusals."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": TEMPERATURE, "seed": 3}
    body |= {"logprobs": 2, "return_token_ids": True, "stop": ["\n"]}
    answers = []
    for content_type in ("application/json", "application/vnd.test+json"):
        # Each computed from scratch: KV reused from a cached prefix may differ in the last bits.
        assert httpx.post(f"{engine.url}/reset_prefix_cache").status_code == 200
        response = httpx.post(
            f"{engine.url}/v1/completions",
            content=orjson.dumps(body),
            headers={"content-type": content_type},
            timeout=TIMEOUT,
        )
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json"
        answer = response.json()
        assert answer.pop("id").startswith("cmpl-") and answer.pop("created") > 0
        answers.append(answer)
    assert answers[0] == answers[1]
    assert answers[0]["choices"][0]["logprobs"]["top_logprobs"][0]  # the fast path kept every field
    # A seed past 64 bits, which orjson would read as a float rounding to -2**63: refused by both.
    for refused in ({**body, "n": 1000}, {**body, "prompt": [1, True]}, {**body, "seed": -(2**63) - 1}):
        statuses = [
            httpx.post(
                f"{engine.url}/v1/completions", content=json.dumps(refused), headers={"content-type": kind}
            )
            for kind in ("application/json", "application/vnd.test+json")
        ]
        assert statuses[0].status_code == statuses[1].status_code in (400, 422)
        assert statuses[0].json() == statuses[1].json()


def test_text_prompt_is_tokenised(engine: RunningServer, checkpoints: tuple[Path, Path]) -> None:
    text = "Reach G and avoid O."
    choice = complete(engine.url, text, seed=3)["choices"][0]  # type: ignore[arg-type]
    assert choice["prompt_token_ids"] == AutoTokenizer.from_pretrained(checkpoints[0]).encode(text)


def test_stop_token_ids_end_generation_with_the_stop_token(engine: RunningServer, prompt: list[int]) -> None:
    free_run = complete(engine.url, prompt, seed=11, ignore_eos=True)["choices"][0]["token_ids"]
    stop = free_run[3]
    stopped = complete(engine.url, prompt, seed=11, ignore_eos=True, stop_token_ids=[stop])["choices"][0]
    cut = free_run.index(stop) + 1
    assert stopped["token_ids"] == free_run[:cut]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop


def test_n_samples_several_choices(engine: RunningServer, prompt: list[int]) -> None:
    body = complete(engine.url, prompt, seed=5, n=3)
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert body["choices"][0]["token_ids"] == complete(engine.url, prompt, seed=5)["choices"][0]["token_ids"]


def test_concurrent_requests_equal_their_solo_results(engine: RunningServer, prompt: list[int]) -> None:
    prompts = [prompt[: len(prompt) - index] for index in range(32)]  # ragged lengths
    solo = [
        complete(engine.url, p, seed=100 + i, max_tokens=10 + i)["choices"][0] for i, p in enumerate(prompts)
    ]
    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = [
            pool.submit(complete, engine.url, p, seed=100 + i, max_tokens=10 + i)
            for i, p in enumerate(prompts)
        ]
        batched = [future.result()["choices"][0] for future in futures]
    for alone, together in zip(solo, batched, strict=True):
        assert together["token_ids"] == alone["token_ids"]
        assert together["logprobs"]["token_logprobs"] == pytest.approx(
            alone["logprobs"]["token_logprobs"], abs=1e-4
        )


def test_reload_weights_changes_samples_and_version(
    engine: RunningServer, checkpoints: tuple[Path, Path], prompt: list[int]
) -> None:
    url = engine.url
    before = complete(url, prompt, seed=21, ignore_eos=True)["choices"][0]
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "default"}
    try:
        assert httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=TIMEOUT).json() == {
            "status": "paused"
        }
        assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoints[1])}}
        assert httpx.post(f"{url}/collective_rpc", json=rpc, timeout=TIMEOUT).json() == {"results": [None]}
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
        updated = httpx.post(f"{url}/update_weight_version", json={"new_version": "1"}).json()
        assert updated == {"success": True, "new_version": "1"}
        assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}
        assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "1"}
        after = complete(url, prompt, seed=21, ignore_eos=True)["choices"][0]
        assert after["token_ids"] != before["token_ids"]
        expected = reference_logprobs(checkpoints[1], prompt, after["token_ids"])
        assert after["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    finally:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoints[0])}}
        httpx.post(f"{url}/resume")
        httpx.post(f"{url}/collective_rpc", json=rpc, timeout=TIMEOUT).raise_for_status()
        httpx.post(f"{url}/update_weight_version", json={"new_version": "default"}).raise_for_status()
    assert complete(url, prompt, seed=21, ignore_eos=True)["choices"][0]["token_ids"] == before["token_ids"]


def test_reload_from_a_bad_path_is_refused(
    engine: RunningServer, checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    def reload(path: Path | str) -> httpx.Response:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        return httpx.post(f"{engine.url}/collective_rpc", json=rpc, timeout=TIMEOUT)

    not_a_checkpoint = checkpoints[0].parent / "empty"  # beside the model: an allowed root
    not_a_checkpoint.mkdir(exist_ok=True)
    response = reload(not_a_checkpoint)
    assert response.status_code == 400 and response.json()["error"]["code"] == "bad_checkpoint"
    # Outside the model's parent and the working directory: refused before anything is read,
    # also when spelled as a path that climbs out of an allowed root.
    for outside in (tmp_path, "/etc", checkpoints[0] / ".." / ".." / ".."):
        refused = reload(outside)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "weights_path_not_allowed"
    unknown = httpx.post(f"{engine.url}/collective_rpc", json={"method": "sleep"})
    assert unknown.status_code == 400


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"prompt": [1] * 2040, "max_tokens": 16}, "context_too_long"),
        ({"prompt": [], "max_tokens": 4}, "empty_prompt"),
        ({"prompt": [10**6], "max_tokens": 4}, "bad_token"),
        ({"prompt": [1, 2], "logit_bias": {"x": 1}}, "bad_logit_bias"),
        ({"prompt": [1, 2], "logit_bias": {"1000000": 1}}, "bad_logit_bias"),
        ({"prompt": [1, 2], "response_format": {"type": "json_object"}}, "unsupported_response_format"),
        ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options_without_stream"),
        ({"prompt": [1, 2], "n": 1000}, "too_many_samples"),
    ],
)
def test_requests_the_engine_cannot_serve_get_400(engine: RunningServer, body: dict, code: str) -> None:
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 4},
        {"prompt": [1, 2], "max_tokens": "many"},
        {"prompt": [1, -2]},
        {"prompt": [1, 2], "temperature": -1},
        {"prompt": [1, 2], "top_p": 0},
        {"prompt": [1, 2], "stop_tokens": [3]},
        {"prompt": [1, True]},  # JSON types exactly: pydantic's lax mode took these
        {"prompt": [1, 2], "n": "2"},
        {"prompt": [1, 2], "stream": 0},
        {"prompt": [1, 2], "logprobs": 21},
        {"prompt": [1, 2], "stop": ["a", "b", "c", "d", "e"]},
        {"prompt": [1, 2], "stop": ""},
        {"prompt": [1, 2], "presence_penalty": 2.5},
        {"prompt": [1, 2], "repetition_penalty": 0},
        {"prompt": [1, 2], "logit_bias": {"1": 101}},
    ],
)
def test_malformed_requests_get_422(engine: RunningServer, body: dict) -> None:
    response = httpx.post(f"{engine.url}/v1/completions", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


def test_unknown_model_is_404(engine: RunningServer, prompt: list[int]) -> None:
    response = httpx.post(f"{engine.url}/v1/completions", json={"model": "other", "prompt": prompt})
    assert response.status_code == 404


def counter(url: str, name: str) -> float:
    """One of the engine's Prometheus samples."""
    metrics = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE).group(1))


def wait_for_in_flight(url: str, count: int) -> None:
    """Wait until ``count`` sequences are admitted: no guessing how long a request takes to arrive."""
    wait_until(
        lambda: counter(url, "engine_sequences_in_flight") == count,
        f"{count} sequences in flight",
        interval_s=0.01,
    )


def test_a_prompt_extending_an_earlier_one_reuses_its_kv(engine: RunningServer, prompt: list[int]) -> None:
    assert httpx.post(f"{engine.url}/reset_prefix_cache").status_code == 200
    before = counter(engine.url, "engine_reused_prompt_tokens_total")
    first = complete(engine.url, prompt, seed=31)["choices"][0]["token_ids"]
    assert counter(engine.url, "engine_reused_prompt_tokens_total") == before
    complete(engine.url, prompt + first + prompt[-4:], seed=32)
    assert counter(engine.url, "engine_reused_prompt_tokens_total") >= before + 16 * (len(prompt) // 16)


def test_past_max_num_seqs_is_429_and_pause_abort_ends_work(
    checkpoints: tuple[Path, Path], prompt: list[int], tmp_path: Path
) -> None:
    server = serve(checkpoints[0], tmp_path, "--max-num-seqs", "2")
    try:
        long = {"max_tokens": 2000, "ignore_eos": True}
        with ThreadPoolExecutor(max_workers=2) as pool:
            running = [pool.submit(complete, server.url, prompt[:20], seed=seed, **long) for seed in (1, 2)]
            wait_for_in_flight(server.url, 2)
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "engine_full"
            httpx.post(f"{server.url}/pause", params={"mode": "abort"}, timeout=TIMEOUT).raise_for_status()
            reasons = [future.result()["choices"][0]["finish_reason"] for future in running]
        assert reasons == ["abort", "abort"]
        held = ThreadPoolExecutor(max_workers=1)
        waiting = held.submit(complete, server.url, prompt, seed=3, max_tokens=4)
        wait_for_in_flight(server.url, 1)  # admitted but held while paused
        assert not waiting.done()
        httpx.post(f"{server.url}/resume").raise_for_status()
        assert len(waiting.result()["choices"][0]["token_ids"]) <= 4
        held.shutdown()
    finally:
        stop_server(server.process)
