"""The CPU engine in the caller's process (``stargym rollout --engine-model``): the same completions
as the engine server's, and the same typed errors, without HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RunningServer, start_engine, stop_server
from transformers import AutoTokenizer

from deploy.model_init import init_tiny_model
from rollout_server.engine.app import EngineState
from rollout_server.engine.in_process import InProcessEngineClient
from rollout_server.engine.serve import load_engine
from rollout_server.engine.settings import EngineSettings
from services.engine_client import EngineClient, EngineContextLengthError, EngineServerError
from services.rollout_protocol import SamplingParams

MAX_MODEL_LEN = 256
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("in-process") / "tiny", 0, ["game"], 20, 20)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_engine(
        model_dir, tmp_path_factory.mktemp("engine"), "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN)
    )
    yield running
    stop_server(running.process)


@pytest.fixture(scope="module")
def state(model_dir: Path) -> Iterator[EngineState]:
    loaded = load_engine(EngineSettings(model=str(model_dir), threads=1, max_model_len=MAX_MODEL_LEN))
    loaded.engine.start()
    yield loaded
    loaded.engine.stop()


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\nReach G and avoid O."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


async def test_in_process_completions_are_the_servers(
    server: RunningServer, state: EngineState, prompt: list[int]
) -> None:
    """Same prompt, sampling and seed: the same tokens, log-probs, text and finish, on both paths;
    with stop ids and with a stop string."""
    async with EngineClient(server.url) as http, InProcessEngineClient(state, "http://in-process") as local:
        stops = sorted(set(prompt[-6:]))
        for seed in range(6):
            options = {
                "seed": seed,
                "stop_token_ids": stops if seed % 2 else None,
                "stop": ["\n"] if seed > 3 else None,
            }
            served = await http.complete(prompt, SAMPLING, **options)
            called = await local.complete(prompt, SAMPLING, **options)
            assert called.token_ids == served.token_ids and called.token_ids
            assert called.logprobs == pytest.approx(served.logprobs, abs=1e-5)
            assert (called.text, called.finish_reason, called.stop_reason) == (
                served.text,
                served.finish_reason,
                served.stop_reason,
            )
            assert called.url == "http://in-process"
        assert local.inflight == {"http://in-process": 0}


async def test_in_process_refusals_raise_what_the_http_client_raises(
    server: RunningServer, state: EngineState, prompt: list[int]
) -> None:
    async with EngineClient(server.url) as http, InProcessEngineClient(state, "http://in-process") as local:
        long = prompt * (MAX_MODEL_LEN // len(prompt) + 1)
        for client in (http, local):
            with pytest.raises(EngineContextLengthError) as refused:
                await client.complete(long, SAMPLING)
            assert refused.value.status == 400 and refused.value.code == "context_too_long"
        wrong = InProcessEngineClient(state, "http://in-process", model="not-served")
        async with wrong:
            with pytest.raises(EngineServerError) as missing:
                await wrong.complete(prompt, SAMPLING)
        assert missing.value.status == 404 and "not-served" in missing.value.message
