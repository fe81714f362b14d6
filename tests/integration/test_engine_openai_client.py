"""The CPU engine's OpenAI routes as the official ``openai`` client drives them, against a real server.

Stop strings, penalties, log-probs and top log-probs, streaming, ``user``, tools and
``response_format``: what the client sends must be accepted and answered as vLLM answers it.
Expected values come from the engine's own unstopped or unstreamed answer for the same seed, or
from a plain transformers forward pass.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from chat_templates import TOOL_HISTORY, TOOLS_TEMPLATE, WEATHER_TOOL
from conftest import RunningServer, start_engine, stop_server, wait_until
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.model_init import init_tiny_model
from rollout_server.engine.chat import template_messages, template_tools
from services.engine_protocol import ChatCompletionRequest

TEMPERATURE = 0.8
TIMEOUT_S = 120.0
QUESTION = [{"role": "user", "content": "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\nReach G and avoid O."}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("openai-client-model") / "policy-v0", 0, ["game"], 20, 20)


@pytest.fixture(scope="module")
def tools_model(tiny_model: Path) -> Path:
    """The tiny policy with a chat template that renders tools and tool calls."""
    copy = tiny_model.parent / "policy-tools"
    shutil.copytree(tiny_model, copy)
    (copy / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return copy


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_engine(tiny_model, tmp_path_factory.mktemp("openai-engine"), "--served-model-name", "tiny")
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def client(engine: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{engine.url}/v1", api_key="EMPTY", timeout=TIMEOUT_S, max_retries=0
    ) as client:
        yield client


def test_chat_accepts_what_an_openai_client_sends(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=12,
        temperature=TEMPERATURE,
        seed=3,
        stop=["zzz", "\n\n"],
        user="agent-7",
        presence_penalty=0.4,
        frequency_penalty=0.3,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and reply.usage is not None
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [top.logprob for top in item.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] >= item.logprob - 1e-6
        assert item.bytes == list(item.token.encode())


def joined_stream(client: openai.OpenAI, **fields) -> tuple[str, list, list]:
    """A streamed chat's content, its log-probs joined, and its chunks."""
    chunks = list(client.chat.completions.create(stream=True, **fields))
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    logprobs = [
        item
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    return content, logprobs, chunks


def test_a_streamed_chat_joins_into_the_plain_reply(client: openai.OpenAI) -> None:
    fields = {"model": "tiny", "messages": QUESTION, "max_tokens": 30, "temperature": TEMPERATURE, "seed": 11}
    plain = client.chat.completions.create(logprobs=True, **fields)
    content, logprobs, chunks = joined_stream(
        client, logprobs=True, stream_options={"include_usage": True}, **fields
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content == plain.choices[0].message.content
    assert [item.logprob for item in logprobs] == [item.logprob for item in plain.choices[0].logprobs.content]
    finish = [
        chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason
    ]
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_completions_logprobs_plain_and_streamed(client: openai.OpenAI) -> None:
    fields = {"model": "tiny", "prompt": "Reach G and avoid O.", "max_tokens": 16, "seed": 5, "logprobs": 2}
    plain = client.completions.create(**fields).choices[0]
    for tokens, logprob, top in zip(
        plain.logprobs.tokens, plain.logprobs.token_logprobs, plain.logprobs.top_logprobs, strict=True
    ):
        assert top[tokens] == logprob and len(top) in (2, 3)
        others = sorted((value for text, value in top.items() if text != tokens), reverse=True)
        assert others[0] >= logprob - 1e-6 or len(top) == 2
    chunks = list(client.completions.create(stream=True, **fields))
    assert "".join(chunk.choices[0].text for chunk in chunks) == plain.text
    streamed = [
        value
        for chunk in chunks
        if chunk.choices[0].logprobs
        for value in chunk.choices[0].logprobs.token_logprobs
    ]
    assert streamed == plain.logprobs.token_logprobs
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason


def test_a_stop_string_ends_generation_and_is_cut_from_the_text(client: openai.OpenAI) -> None:
    body = {
        "model": "tiny",
        "prompt": "Reach G and avoid O.",
        "max_tokens": 40,
        "seed": 9,
        "temperature": TEMPERATURE,
    }
    extra = {"ignore_eos": True, "return_token_ids": True}
    free = client.completions.create(extra_body=extra, **body).choices[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 4]
    cut = free.text.index(stop)
    for streamed in (False, True):
        answer = client.completions.create(stop=stop, stream=streamed, extra_body=extra, **body)
        chunks = list(answer) if streamed else [answer]
        text = "".join(chunk.choices[0].text for chunk in chunks)
        last = chunks[-1].choices[0]
        assert text == free.text[:cut]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
        token_ids = [token for chunk in chunks for token in chunk.choices[0].model_extra["token_ids"]]
        assert token_ids == free.model_extra["token_ids"][: len(token_ids)]
        assert len(token_ids) < 40  # it stopped at the token that completed the stop string


def test_penalties_are_applied_as_openai_defines_them(client: openai.OpenAI, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "seed": 13,
        "temperature": TEMPERATURE,
        "logprobs": 0,
    }
    extra = {"ignore_eos": True, "return_token_ids": True}
    plain = client.completions.create(extra_body=extra, **body).choices[0]
    penalised = client.completions.create(
        frequency_penalty=2.0, presence_penalty=0.5, extra_body=extra, **body
    ).choices[0]
    assert (
        penalised.model_extra["token_ids"] != plain.model_extra["token_ids"]
        or penalised.logprobs.token_logprobs != plain.logprobs.token_logprobs
    )
    tokens = penalised.model_extra["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    counts = torch.zeros(logits.shape[1])
    for position in range(3):
        by_hand = logits[position] - 2.0 * counts - 0.5 * (counts > 0)
        expected = torch.log_softmax(by_hand / TEMPERATURE, dim=-1)[tokens[position]].item()
        assert penalised.logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-4)
        counts[tokens[position]] += 1


def test_response_format_json_is_refused_with_a_reason(client: openai.OpenAI) -> None:
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="tiny", messages=QUESTION, max_tokens=2, response_format=response_format
            )
        error = refused.value.body.get("error", refused.value.body)
        assert error["code"] == "unsupported_response_format"
        assert "cannot constrain decoding to JSON" in error["message"]
    text = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=2, response_format={"type": "text"}
    )
    assert text.choices[0].message.content is not None


def test_tools_are_rendered_and_a_tool_round_trip_is_accepted(
    tools_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_engine(tools_model, tmp_path_factory.mktemp("tools-engine"), "--served-model-name", "tiny")
    try:
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="EMPTY", timeout=TIMEOUT_S, max_retries=0
        ) as client:
            without = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, seed=1)
            with_tools = client.chat.completions.create(
                model="tiny",
                messages=QUESTION,
                max_tokens=4,
                seed=1,
                tools=[WEATHER_TOOL],
                tool_choice="required",
            )
            assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens
            history = TOOL_HISTORY
            answer = client.chat.completions.create(
                model="tiny",
                messages=history,
                max_tokens=4,
                seed=2,
                tools=[WEATHER_TOOL],
                tool_choice="auto",
                parallel_tool_calls=True,
            )
            assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # The prompt is the template's rendering of exactly these messages and tools.
        tokenizer = AutoTokenizer.from_pretrained(tools_model)
        request = ChatCompletionRequest.model_validate({"messages": history, "tools": [WEATHER_TOOL]})
        text = tokenizer.apply_chat_template(
            template_messages(request),
            tools=template_tools(request),
            tokenize=False,
            add_generation_prompt=True,
        )
        assert (
            '"name": "get_weather"' in text
            and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
        )
        assert (
            "<tool_response>\nsunny\n</tool_response>" in text
            and "<|im_start|>system\nUse the tools." in text
        )
        assert answer.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    finally:
        stop_server(server.process)


def in_flight(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^engine_sequences_in_flight (\S+)$", metrics, re.MULTILINE).group(1))


def generated(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^engine_generated_tokens_total (\S+)$", metrics, re.MULTILINE).group(1))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_mid_stream_frees_its_sequence(engine: RunningServer, route: str) -> None:
    wait_until(lambda: in_flight(engine.url) == 0, "an idle engine", deadline_s=30)
    before = generated(engine.url)
    body = {"model": "tiny", "max_tokens": 1900, "ignore_eos": True, "stream": True, "seed": 1}
    body |= {"prompt": [5, 6, 7]} if route == "/v1/completions" else {"messages": QUESTION}
    with (
        httpx.Client(timeout=TIMEOUT_S) as http,
        http.stream("POST", f"{engine.url}{route}", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["index"] == 0
        assert in_flight(engine.url) == 1
    # The connection is closed: the engine aborts the sequence long before 1900 tokens.
    wait_until(lambda: in_flight(engine.url) == 0, "the abandoned sequence to be freed", deadline_s=30)
    assert generated(engine.url) - before < 1900
