"""Agent jobs through the rollout worker's recording proxy, driven by the official ``openai`` client.

A real worker process (``stargym rollout``) takes ``agent`` jobs from real Redis and plays them
against a real game env server and a real CPU engine serving the tiny policy with a chat template
that renders tools. Most tests are the outside harness themselves: the job names this test's own
HTTP server as its agent, the worker POSTs it the session (``HarnessCall``), and the test talks
to the session with the ``openai`` package and ends it with ``/finish``. The recorded token ids
and log-probs are checked against the engine's own answer for the same prompt and seed.
"""

from __future__ import annotations

import json
import queue
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from chat_templates import TOOL_HISTORY, TOOLS_TEMPLATE, WEATHER_TOOL
from conftest import (
    POLL,
    REPO_ROOT,
    RunningServer,
    free_port,
    loopback_http_server,
    start_engine,
    start_server,
    stop_server,
    wait_until,
)
from transformers import AutoTokenizer

from deploy.model_init import init_tiny_model
from services.agent_protocol import HarnessCall
from services.rollout_protocol import DATA_FIELD, RolloutJob, RunKeys, SamplingParams, Trajectory

KEYS = RunKeys("test-agent-proxy")
DEADLINE_S = 120.0
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy with a chat template that renders tools and tool calls."""
    plain = init_tiny_model(tmp_path_factory.mktemp("proxy-model") / "policy-v0", 0, ["game"], 20, 20)
    tools = plain.parent / "policy-tools"
    shutil.copytree(plain, tools)
    (tools / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return tools


@pytest.fixture(scope="module")
def tokenizer(model: Path):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_engine(model, tmp_path_factory.mktemp("proxy-engine"), "--threads", "1")
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def harness() -> Iterator[tuple[str, queue.Queue[HarnessCall]]]:
    """This test as an outside harness: a real HTTP server that takes the worker's calls (202)."""
    calls: queue.Queue[HarnessCall] = queue.Queue()

    def take(path: str, body: bytes) -> int:
        calls.put(HarnessCall.model_validate_json(body))
        return 202

    with loopback_http_server(lambda path: 404, on_post=take) as url:
        yield f"{url}/episodes", calls


@pytest.fixture(scope="module")
def worker(
    engine: RunningServer,
    game_server: RunningServer,
    model: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    server = start_worker(
        engine, model, KEYS, game_server, redis_url, tmp_path_factory.mktemp("proxy-worker")
    )
    yield server
    stop_server(server.process)


def start_worker(
    engine: RunningServer, model: Path, keys: RunKeys, game_server: RunningServer, redis_url: str, logs: Path
) -> RunningServer:
    """A rollout worker (``stargym rollout``) of ``keys``' run, playing on ``engine``."""
    port = free_port()
    args = ["rollout", "--engine-url", engine.url, "--tokenizer", str(model), "--port", str(port)]
    args += ["--run", keys.run_id, "--env", f"game={game_server.url}"]
    variables = {"REDIS_URL": redis_url, "STARGYM_LOG_LEVEL": "info", "STARGYM_ROLLOUT_AGENT_TIMEOUT_S": "60"}
    return start_server(args, port, logs, env=variables, name="worker")


# What the tool-calling policy writes: the two halves of a call, one token each. The first alone
# is a call written badly (its JSON lacks the closing brace); both make the call the template renders.
CALL_OPEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}'
CALL_CLOSE = "}\n</tool_call>"
TOOL_CALLER_KEYS = RunKeys("test-agent-proxy-tools")


@pytest.fixture(scope="module")
def tool_caller(model: Path) -> Path:
    """A policy that always calls ``get_weather``: a random tiny model cannot, so its weights are set.

    The two halves of the call are tokens of its tokenizer. With every layer's output projections
    at zero the last position's hidden state is its token's embedding, which the final norm
    reduces to three coordinates: "any token", "after CALL_OPEN", "after CALL_CLOSE". The output
    head maps them to CALL_OPEN, CALL_CLOSE and the end of the turn with logit gaps of hundreds,
    so even sampled at temperature 1 the reply is the whole call, and ``max_tokens=1`` cuts it
    to its malformed first half.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    caller = model.parent / "policy-tool-caller"
    shutil.copytree(model, caller)
    tokenizer = AutoTokenizer.from_pretrained(caller)
    tokenizer.add_tokens([CALL_OPEN, CALL_CLOSE])
    tokenizer.save_pretrained(caller)
    policy = AutoModelForCausalLM.from_pretrained(caller)
    policy.resize_token_embeddings(len(tokenizer))
    call_open, call_close, end = tokenizer.convert_tokens_to_ids([CALL_OPEN, CALL_CLOSE, "<|im_end|>"])
    with torch.no_grad():
        for layer in policy.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = policy.model.embed_tokens.weight
        embedding[:, :3] = torch.tensor([10.0, 0.0, 0.0])
        embedding[call_open, 1] = embedding[call_close, 2] = 10.0
        policy.model.norm.weight.zero_()
        policy.model.norm.weight[:3] = 1.0
        head = policy.lm_head.weight
        head.zero_()
        head[call_open, :3] = torch.tensor([5.0, -10.0, -10.0])
        head[call_close, :3] = torch.tensor([0.0, 10.0, -10.0])
        head[end, :3] = torch.tensor([0.0, -10.0, 10.0])
    policy.save_pretrained(caller)
    return caller


@pytest.fixture(scope="module")
def tool_caller_worker(
    tool_caller: Path, game_server: RunningServer, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """An engine serving the tool-calling policy and a worker of a run of its own."""
    engine = start_engine(tool_caller, tmp_path_factory.mktemp("caller-engine"), "--threads", "1")
    try:
        logs = tmp_path_factory.mktemp("caller-worker")
        server = start_worker(engine, tool_caller, TOOL_CALLER_KEYS, game_server, redis_url, logs)
        yield server
        stop_server(server.process)
    finally:  # a worker that failed to start must not leave the engine running past the tests
        stop_server(engine.process)


@pytest.fixture(scope="module")
def db(redis_url: str) -> Iterator[redis.Redis]:
    """The session's Redis; this module's run has names of its own, so nothing is flushed."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def publish(
    db: redis.Redis,
    agent: str,
    *,
    env: str = "game/bandit",
    max_turns: int = 4,
    seed: int = 3,
    keys: RunKeys = KEYS,
) -> RolloutJob:
    """An agent job on ``keys``' run: the worker serving that run plays it."""
    job = RolloutJob(
        run_id=keys.run_id,
        env=env,
        seed=seed,
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        max_turns=max_turns,
        sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=100 + seed),
        policy_version=0,
        agent=agent,
    )
    db.xadd(keys.jobs, {DATA_FIELD: job.model_dump_json()})
    return job


def trajectory_of(db: redis.Redis, job: RolloutJob, worker: RunningServer) -> Trajectory:
    def find() -> Trajectory | None:
        for _, fields in db.xrange(RunKeys(job.run_id).trajectories):
            trajectory = Trajectory.model_validate_json(fields[DATA_FIELD.encode()])
            if trajectory.job_id == job.job_id:
                return trajectory
        return None

    return wait_until(find, f"the trajectory of {job.job_id}", deadline_s=DEADLINE_S, logs=[worker])


def session(
    db: redis.Redis, harness: tuple[str, queue.Queue[HarnessCall]], **job_fields
) -> tuple[RolloutJob, HarnessCall, openai.OpenAI]:
    """Publish an agent job for this test's harness; the call the worker makes, and a client of it."""
    url, calls = harness
    job = publish(db, url, **job_fields)
    call = calls.get(timeout=DEADLINE_S)
    assert call.task.job_id == job.job_id and call.task.max_turns == job.max_turns
    client = openai.OpenAI(base_url=call.base_url, api_key=call.api_key, timeout=DEADLINE_S, max_retries=0)
    return job, call, client


def finish(call: HarnessCall, **outcome) -> dict:
    response = httpx.post(call.finish_url, json=outcome, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def engine_sample(engine: RunningServer, prompt: list[int], seed: int, stop: list[str] | None = None) -> dict:
    """The engine's own answer for this prompt under the job's sampling and this seed."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if stop:
        body["stop"] = stop
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=DEADLINE_S)
    response.raise_for_status()
    return response.json()["choices"][0]


def turn_spans(trajectory: Trajectory) -> list[tuple[int, int, int]]:
    """Per turn: where its prompt starts, where its reply starts, where it ends."""
    spans, position = [], 0
    for turn in trajectory.turns:
        spans.append(
            (position, position + turn.prompt_tokens, position + turn.prompt_tokens + turn.response_tokens)
        )
        position = spans[-1][2]
    return spans


def test_a_session_records_exactly_what_the_engine_sampled(
    db: redis.Redis, harness, worker: RunningServer, engine: RunningServer, tokenizer
) -> None:
    job, call, client = session(db, harness)
    assert call.task.instruction and "arms" in call.task.observation
    assert [card.id for card in client.models.list().data] == ["policy"]
    first = [{"role": "user", "content": f"{call.task.instruction}\n\n{call.task.observation}"}]
    # What OpenAI clients send, accepted; sampling stays the run's (penalties are not applied).
    reply = client.chat.completions.create(
        model="gpt-4o",
        messages=first,
        logprobs=True,
        top_logprobs=2,
        user="someone",
        presence_penalty=0.5,
        temperature=0.1,
        stop=["\n\n"],
    )
    choice = reply.choices[0]
    assert reply.usage.completion_tokens == len(choice.logprobs.content) >= 1
    assert all(len(entry.top_logprobs) <= 2 for entry in choice.logprobs.content)
    # The SDK's own message object goes back into the history, as agents write it.
    second = [*first, choice.message, {"role": "user", "content": "Which arm now?"}]
    stream = client.chat.completions.create(
        model="policy", messages=second, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert finish(call, reward=0.5) == {"session_id": call.session_id, "turns": 2, "segments": 1}

    trajectory = trajectory_of(db, job, worker)
    assert trajectory.error is None and trajectory.kind == "agent"
    assert trajectory.reward == 0.5 and trajectory.success and trajectory.num_turns == 2
    assert trajectory.segments == [] and not trajectory.truncated
    assert [turn.reward for turn in trajectory.turns] == [0.0, 0.5]
    assert trajectory.turns[0].response == (choice.message.content or "")
    assert trajectory.turns[1].response == streamed
    ids = trajectory.token_ids
    (p1, r1, e1), (_, r2, e2) = turn_spans(trajectory)
    assert e2 == len(ids) and trajectory.loss_mask == [0] * (r1 - p1) + [1] * (e1 - r1) + [0] * (r2 - e1) + [
        1
    ] * (e2 - r2)
    # The prompts are the template's rendering of what the agent sent, the replies never re-tokenised.
    assert tokenizer.decode(ids[:r1], skip_special_tokens=False) == render(tokenizer, first)
    context = tokenizer.decode(ids[:r2], skip_special_tokens=False)
    assert context.startswith(
        render(tokenizer, first) + tokenizer.decode(ids[r1:e1], skip_special_tokens=False)
    )
    assert context.endswith("<|im_start|>user\nWhich arm now?<|im_end|>\n<|im_start|>assistant\n")
    # Each reply is what the engine samples for that exact prompt and the turn's seed.
    for turn, (_, start, end) in enumerate([(p1, r1, e1), (e1, r2, e2)]):
        expected = engine_sample(
            engine, ids[:start], job.sampling.seed + turn, ["\n\n"] if turn == 0 else None
        )
        assert ids[start:end] == expected["token_ids"]
        assert trajectory.logprobs[start:end] == pytest.approx(
            expected["logprobs"]["token_logprobs"], abs=1e-5
        )
    assert [entry.logprob for entry in choice.logprobs.content] == pytest.approx(
        trajectory.logprobs[r1:e1], abs=1e-6
    )


def test_a_rewritten_history_starts_a_new_segment_and_the_env_reward_counts(
    db: redis.Redis, harness, worker: RunningServer, tokenizer, game_server: RunningServer
) -> None:
    job, call, client = session(db, harness)
    first = [{"role": "user", "content": call.task.observation}]
    one = client.chat.completions.create(model="policy", messages=first).choices[0].message
    second = [*first, {"role": "assistant", "content": one.content}, {"role": "user", "content": "Again."}]
    two = client.chat.completions.create(model="policy", messages=second).choices[0].message
    # The agent summarises: the history it sends no longer extends what the model saw.
    summary = [{"role": "user", "content": f"So far you answered {two.content!r}. Pick an arm."}]
    client.chat.completions.create(model="policy", messages=summary)
    step = httpx.post(
        f"{call.task.env_url}/instances/{call.task.instance_id}/step", json={"action": "Phoenix"}, timeout=30
    )
    assert step.status_code == 200 and step.json()["reward"] == pytest.approx(0.15)
    assert finish(call)["segments"] == 2  # no reward: the env's total is the episode's

    trajectory = trajectory_of(db, job, worker)
    assert trajectory.error is None and trajectory.num_turns == 3
    assert trajectory.reward == pytest.approx(0.15) and trajectory.success  # the reward, with no verdict
    (_, _, _), (_, _, end_two), (start_three, reply_three, _) = turn_spans(trajectory)
    assert trajectory.segments == [end_two] == [start_three]
    # The new segment is the summary's whole prompt, then its reply: nothing of the first segment.
    segment = trajectory.token_ids[start_three:]
    assert tokenizer.decode(segment[: reply_three - start_three], skip_special_tokens=False) == render(
        tokenizer, summary
    )
    assert (
        trajectory.turns[1].observation == "Again."
        and "So far you answered" in trajectory.turns[2].observation
    )


def test_tools_round_trip_through_the_template_and_one_segment(
    db: redis.Redis, harness, worker: RunningServer, tokenizer
) -> None:
    job, call, client = session(db, harness)
    history = TOOL_HISTORY
    reply = client.chat.completions.create(
        model="policy", messages=history, tools=[WEATHER_TOOL], tool_choice="auto"
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    more = [*history, message, {"role": "tool", "tool_call_id": "call_1", "content": "rainy"}]
    client.chat.completions.create(model="policy", messages=more, tools=[WEATHER_TOOL])
    # Other tools change the prompt from its start: a new segment.
    client.chat.completions.create(model="policy", messages=more, tools=[])
    finish(call, reward=1.0, success=False)

    trajectory = trajectory_of(db, job, worker)
    assert trajectory.error is None and not trajectory.success and trajectory.reward == 1.0
    spans = turn_spans(trajectory)
    assert trajectory.segments == [spans[2][0]]
    text = tokenizer.decode(trajectory.token_ids[: spans[0][1]], skip_special_tokens=False)
    assert text == render(tokenizer, _template_history(history), [WEATHER_TOOL])
    assert (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "<tool_response>\nsunny" in text
    )
    second_prompt = tokenizer.decode(
        trajectory.token_ids[spans[1][0] : spans[1][1]], skip_special_tokens=False
    )
    assert "<tool_response>\nrainy\n</tool_response>" in second_prompt and "<tools>" not in second_prompt


def test_a_call_the_model_writes_goes_to_the_agent_and_back_in_one_segment(
    db: redis.Redis, harness, tool_caller_worker: RunningServer, tool_caller: Path
) -> None:
    """The model's own tool calls: parsed for the agent, taken back with the tool's answer as the
    same conversation, the recorded ids the sampled ones; a call written badly is plain content
    (200, not an error) and its turn invalid."""
    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    job, call, client = session(db, harness, keys=TOOL_CALLER_KEYS)
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    for answer in ("rainy", "still rainy"):
        choice = client.chat.completions.create(
            model="policy", messages=messages, tools=[WEATHER_TOOL]
        ).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [made] = choice.message.tool_calls
        assert made.function.name == "get_weather" and json.loads(made.function.arguments) == {
            "city": "Paris"
        }
        messages += [choice.message, {"role": "tool", "tool_call_id": made.id, "content": answer}]
    bad = client.chat.completions.create(
        model="policy", messages=messages, tools=[WEATHER_TOOL], max_tokens=1
    )
    assert bad.choices[0].finish_reason == "length" and not bad.choices[0].message.tool_calls
    assert bad.choices[0].message.content == CALL_OPEN
    finish(call, reward=1.0)

    trajectory = trajectory_of(db, job, tool_caller_worker)
    assert trajectory.error is None and trajectory.segments == [] and trajectory.num_turns == 3
    call_open, call_close, end = tokenizer.convert_tokens_to_ids([CALL_OPEN, CALL_CLOSE, "<|im_end|>"])
    spans = turn_spans(trajectory)
    assert [trajectory.token_ids[reply:stop] for _, reply, stop in spans] == [
        [call_open, call_close, end],
        [call_open, call_close, end],
        [call_open],
    ]
    assert [turn.actions for turn in trajectory.turns] == [["get_weather"], ["get_weather"], []]
    assert [turn.valid for turn in trajectory.turns] == [True, True, False]
    # The conversation the agent sent back, rendered by the template, is exactly what was recorded.
    sent = [item if isinstance(item, dict) else item.model_dump() for item in messages]
    recorded = tokenizer.decode(trajectory.token_ids[: spans[2][1]], skip_special_tokens=False)
    assert recorded == render(tokenizer, _template_history(sent), [WEATHER_TOOL])


def _template_history(history: list[dict]) -> list[dict]:
    """``history`` as the template sees it: developer as system, tool-call arguments parsed."""
    rendered = []
    for message in history:
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        if message.get("tool_calls"):
            message["content"] = message["content"] or ""
            message["tool_calls"] = [
                {
                    **call,
                    "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])},
                }
                for call in message["tool_calls"]
            ]
        rendered.append(message)
    return rendered


def test_what_a_session_refuses_is_a_clear_4xx_and_the_turn_limit_truncates(
    db: redis.Redis, harness, worker: RunningServer
) -> None:
    job, call, client = session(db, harness, max_turns=1)
    messages = [{"role": "user", "content": call.task.observation}]

    def refused(**fields) -> str | None:
        with pytest.raises(openai.BadRequestError) as refusal:
            client.chat.completions.create(model="policy", messages=messages, **fields)
        return refusal.value.code

    assert refused(n=2) == "one_choice_per_call"
    assert refused(response_format={"type": "json_object"}) == "unsupported_response_format"
    client.chat.completions.create(model="policy", messages=messages)
    assert refused() == "turn_limit_reached"
    missing = httpx.post(f"{worker.url}/sessions/nope/v1/chat/completions", json={"messages": messages})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    finish(call, reward=0.0)
    again = httpx.post(call.finish_url, json={"reward": 1.0}, timeout=30)
    # Finished (409) until the worker closes it, which it does at once (then 404).
    assert again.status_code in (404, 409) and again.json()["error"]["code"] in (
        "not_found",
        "session_finished",
    )
    trajectory = trajectory_of(db, job, worker)
    assert trajectory.truncated and trajectory.num_turns == 1 and trajectory.error is None
    assert trajectory.reward == 0.0 and not trajectory.success


def test_a_python_agent_written_with_openai_plays_the_bandit(db: redis.Redis, worker: RunningServer) -> None:
    jobs = [publish(db, "examples.openai_agent:play", max_turns=2, seed=seed) for seed in range(4)]
    for job in jobs:
        trajectory = trajectory_of(db, job, worker)
        assert trajectory.error is None, trajectory.error
        assert 1 <= trajectory.num_turns <= 2 and sum(trajectory.loss_mask) >= 1
        # The env's reward and verdict: Dragon pays 1 or 0 (success), Phoenix 0.15, anything else 0.
        assert trajectory.reward in (0.0, 0.15, 1.0)
        # Each step is credited to the reply before it: the action sent, and whether the env took it.
        for turn in trajectory.turns:
            assert turn.actions == [turn.response]
            assert turn.valid == (turn.response.strip(".'\" ").lower() in ("dragon", "phoenix"))
        if trajectory.reward == 1.0:
            assert trajectory.success  # Dragon's payout
        if trajectory.reward == 0.15:
            assert not trajectory.success  # Phoenix
    broken = publish(db, "examples.openai_agent:missing")
    assert "has no async function 'missing'" in (trajectory_of(db, broken, worker).error or "")


def test_a_harness_without_a_server_takes_its_episodes_by_rest(
    db: redis.Redis, worker: RunningServer
) -> None:
    """``agent: pull``: the harness asks the worker for work (POST /sessions) instead of serving it."""
    assert httpx.post(f"{worker.url}/sessions", timeout=30).status_code == 204  # nothing waits yet
    job = publish(db, "pull")
    taken = wait_until(
        lambda: (answer := POLL.post(f"{worker.url}/sessions", timeout=30)).status_code == 201 and answer,
        "the episode to be offered",
        deadline_s=DEADLINE_S,
        logs=[worker],
    )
    call = HarnessCall.model_validate(taken.json())
    assert call.task.job_id == job.job_id
    assert httpx.post(f"{worker.url}/sessions", timeout=30).status_code == 204  # taken once
    # Plain HTTP, as a harness in another language would send it.
    body = {"model": "policy", "messages": [{"role": "user", "content": call.task.observation}]}
    reply = httpx.post(f"{call.base_url}/chat/completions", json=body, timeout=DEADLINE_S)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
    finish(call, reward=0.25)
    trajectory = trajectory_of(db, job, worker)
    assert trajectory.error is None and trajectory.reward == 0.25 and trajectory.num_turns == 1


def test_the_readme_example_is_the_agent_these_tests_train() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("<!-- readme-example: openai-agent -->\n```python\n", 1)[1].split("```", 1)[0]
    assert block in (REPO_ROOT / "examples/openai_agent.py").read_text()
