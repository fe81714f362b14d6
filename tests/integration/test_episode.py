"""The episode runner against a real game env server and a real CPU engine serving the tiny policy.

What a trajectory must hold for training: token ids, loss mask and log-probs aligned; the masked
tokens exactly what was sampled; behaviour log-probs that a fresh transformers forward pass over
the whole context reproduces; a prompt that is the env instruction and observations under the
chat template, extended turn by turn. Plus the ends of an episode (env done, max_turns, context
limit), what a truncated episode keeps after its last reply, the answer-tags format, failures,
and the engine client on its own.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from conftest import RunningServer, free_port, start_engine, stop_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.model_init import init_tiny_model
from rollout_server.actions import FORMAT_PENALTY, plain_stop_token_ids
from rollout_server.episode import ChatFormat, EpisodeEnvError, run_episode
from services.engine_client import (
    Completion,
    EngineBusyError,
    EngineClient,
    EngineConnectionError,
    EngineContextLengthError,
)
from services.env_client import EnvClient
from services.rollout_protocol import RolloutJob, SamplingParams, Trajectory

TEMPERATURE = 0.8
FROZENLAKE = "game/frozenlake"
BANDIT = "game/bandit"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("episode-model") / "policy-v0", 0, ["game"], 20, 20)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def engine_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_engine(model_dir, tmp_path_factory.mktemp("episode-engine"))
    yield server
    stop_server(server.process)


@pytest.fixture
async def envs(game_server: RunningServer) -> AsyncIterator[EnvClient]:
    async with EnvClient(game_server.url, timeout=30.0) as client:
        yield client


@pytest.fixture
async def engine(engine_server: RunningServer) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine_server.url, timeout=120.0) as client:
        yield client


@pytest.fixture
async def instructions(envs: EnvClient) -> dict[str, str]:
    return {spec.id: spec.instruction for spec in await envs.list_envs()}


def make_job(env: str, seed: int, **fields: Any) -> RolloutJob:
    sampling = fields.pop(
        "sampling", SamplingParams(temperature=TEMPERATURE, top_p=1.0, max_tokens=8, seed=seed)
    )
    defaults = {"run_id": "test", "group_id": f"g{seed}", "max_turns": 5, "policy_version": 3}
    return RolloutJob(env=env, seed=seed, sampling=sampling, **(defaults | fields))


async def instance_ids(envs: EnvClient) -> set[str]:
    return {instance.instance_id for instance in (await envs.list_instances()).instances}


# -- checks of a trajectory -------------------------------------------------------------------


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each maximal run of equal mask values."""
    out, start = [], 0
    for value, group in itertools.groupby(mask):
        length = len(list(group))
        out.append((value, start, start + length))
        start += length
    return out


def tail_length(trajectory: Trajectory) -> int:
    """Tokens after the last sampled one: the state a truncated episode was cut in (else none)."""
    sampled = [i for i, m in enumerate(trajectory.loss_mask) if m]
    return len(trajectory.token_ids) - (sampled[-1] + 1 if sampled else 0)


def check_aligned(trajectory: Trajectory) -> None:
    n = len(trajectory.token_ids)
    assert len(trajectory.loss_mask) == len(trajectory.logprobs) == n
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m == 1)
    tail = tail_length(trajectory)
    assert sum(turn.prompt_tokens + turn.response_tokens for turn in trajectory.turns) + tail == n
    # An episode the env finished ends with its last reply; a truncated one that has played a turn
    # (and was not refused by the engine) ends with the next observation appended.
    if trajectory.turns[-1].done:
        assert tail == 0
    else:
        assert trajectory.truncated and tail > 0
    assert trajectory.num_turns == len(trajectory.turns) >= 1
    assert trajectory.reward == pytest.approx(sum(turn.reward for turn in trajectory.turns))
    # Turn by turn: a prompt block (mask 0) then the reply (mask 1), in order, of the recorded sizes.
    position = 0
    for turn in trajectory.turns:
        assert turn.response_tokens >= 1
        assert trajectory.loss_mask[position : position + turn.prompt_tokens] == [0] * turn.prompt_tokens
        position += turn.prompt_tokens
        assert trajectory.loss_mask[position : position + turn.response_tokens] == [1] * turn.response_tokens
        position += turn.response_tokens
    assert {"env_s", "generate_s", "total_s"} <= set(trajectory.timings)
    assert trajectory.timings["total_s"] >= trajectory.timings["generate_s"] > 0


def check_sampled_text(trajectory: Trajectory, tokenizer: Any) -> None:
    """The masked tokens decode to exactly the responses, turn by turn and all together."""
    sampled = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    assert tokenizer.decode(sampled, skip_special_tokens=True) == "".join(
        t.response for t in trajectory.turns
    )
    replies = [(s, e) for value, s, e in runs(trajectory.loss_mask) if value == 1]
    assert len(replies) == len(trajectory.turns)
    for (start, end), turn in zip(replies, trajectory.turns, strict=True):
        assert tokenizer.decode(trajectory.token_ids[start:end], skip_special_tokens=True) == turn.response


def spelled(tokenizer: Any, text: str) -> str:
    """``text`` as ``tokenizer``'s ids can hold it."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


def check_prompt_text(trajectory: Trajectory, tokenizer: Any, instruction: str) -> None:
    """The unmasked tokens are the chat template around the instruction and the observations.

    Written out for the tiny model's (Qwen's) template, independently of the runner's own
    template slicing: the first block is the first user message and the generation prompt;
    each later block closes the previous reply (unless it ended with <|im_end|>) and adds
    the next observation as a user message.
    """
    blocks = [(s, e) for value, s, e in runs(trajectory.loss_mask) if value == 0]
    first = trajectory.turns[0].observation
    assert tokenizer.decode(trajectory.token_ids[slice(*blocks[0])]) == (
        f"{IM_START}user\n{instruction}\n\n{first}{IM_END}\n{IM_START}assistant\n"
    )
    replies = [(s, e) for value, s, e in runs(trajectory.loss_mask) if value == 1]
    for index, (start, end) in enumerate(blocks[1:]):
        ended = trajectory.token_ids[replies[index][1] - 1] == tokenizer.convert_tokens_to_ids(IM_END)
        closing = "\n" if ended else f"{IM_END}\n"
        text = tokenizer.decode(trajectory.token_ids[start:end])
        if index + 1 == len(trajectory.turns):  # a truncated episode's final observation, in no turn
            assert text.startswith(f"{closing}{IM_START}user\n")
            assert text.endswith(f"{IM_END}\n{IM_START}assistant\n")
            continue
        # As the tokenizer can spell it: a random reply echoed by the env may hold a character
        # outside the tiny tokenizer's alphabet (a U+FFFD from a partial UTF-8 token), whose
        # missing bytes BPE drops (deploy/tiny_model.py: no unknown token).
        observation = spelled(tokenizer, trajectory.turns[index + 1].observation)
        assert text == f"{closing}{IM_START}user\n{observation}{IM_END}\n{IM_START}assistant\n"


def check_logprobs(trajectory: Trajectory, model: Any) -> None:
    """log_softmax(logits / T) of a fresh forward pass over the whole context, at the sampled tokens."""
    ids = torch.tensor([trajectory.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    reference = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    sampled = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert sampled and sampled[0] > 0
    expected = [reference[i - 1, trajectory.token_ids[i]].item() for i in sampled]
    got = [trajectory.logprobs[i] for i in sampled]
    assert got == pytest.approx(expected, abs=1e-4)


# -- episodes ---------------------------------------------------------------------------------


async def test_frozenlake_episodes(
    envs: EnvClient,
    engine: EngineClient,
    tokenizer: Any,
    reference_model: Any,
    instructions: dict[str, str],
) -> None:
    before = await instance_ids(envs)
    jobs = [make_job(FROZENLAKE, seed, max_turns=6) for seed in range(6)]
    trajectories = await asyncio.gather(
        *(
            run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 3, max_model_len=2048)
            for job in jobs
        )
    )
    assert await instance_ids(envs) <= before  # every instance closed
    multi_turn = 0
    for job, trajectory in zip(jobs, trajectories, strict=True):
        assert trajectory.job_id == job.job_id and trajectory.env == FROZENLAKE
        assert trajectory.policy_version == 3 and all(t.policy_version == 3 for t in trajectory.turns)
        check_aligned(trajectory)
        check_sampled_text(trajectory, tokenizer)
        check_prompt_text(trajectory, tokenizer, instructions[FROZENLAKE])
        check_logprobs(trajectory, reference_model)
        for turn in trajectory.turns:
            assert turn.response_tokens <= job.sampling.max_tokens
            assert turn.actions == [turn.response.strip()]
        last = trajectory.turns[-1]
        assert trajectory.truncated == (not last.done)
        assert trajectory.truncated == (trajectory.num_turns == job.max_turns and not last.done)
        assert trajectory.success == (trajectory.reward == 1.0)
        # The turn-by-turn observations are the env's: the next one follows from the action.
        assert all(
            "Reach G and avoid O." in t.observation or "Invalid" in t.observation for t in trajectory.turns
        )
        multi_turn += trajectory.num_turns > 1
        # It survives the stream: JSON and back.
        assert Trajectory.model_validate_json(trajectory.model_dump_json()) == trajectory
    assert multi_turn, "a random policy should not finish every episode in one turn"


@pytest.mark.parametrize("history_turns", [0, 1])
async def test_history_window_sends_each_turn_its_window_as_a_sequence(
    envs: EnvClient,
    engine: EngineClient,
    tokenizer: Any,
    reference_model: Any,
    instructions: dict[str, str],
    history_turns: int,
) -> None:
    """Past ``history_turns`` every turn's prompt is a new sequence (``segments``): the instruction
    before the oldest kept observation, the kept turns, the current observation. The engine saw
    exactly that sequence: a fresh forward pass over it alone gives the behaviour log-probs."""
    instruction = instructions[FROZENLAKE]
    windowed = 0
    for seed in range(8):
        job = make_job(FROZENLAKE, seed, max_turns=6, history_turns=history_turns)
        trajectory = await run_episode(job, envs, engine, tokenizer, instruction, 3, max_model_len=2048)
        check_aligned(trajectory)
        check_sampled_text(trajectory, tokenizer)
        turns = trajectory.turns
        starts = list(itertools.accumulate([0] + [t.prompt_tokens + t.response_tokens for t in turns]))
        assert trajectory.segments == [starts[t] for t in range(history_turns + 1, len(turns))]
        bounds = [0, *trajectory.segments, len(trajectory.token_ids)]
        for start, end in itertools.pairwise(bounds):
            sequence = trajectory.model_copy(
                update={
                    "token_ids": trajectory.token_ids[start:end],
                    "loss_mask": trajectory.loss_mask[start:end],
                    "logprobs": trajectory.logprobs[start:end],
                }
            )
            check_logprobs(sequence, reference_model)
        for index in range(history_turns + 1, len(turns)):
            prompt = tokenizer.decode(
                trajectory.token_ids[starts[index] : starts[index] + turns[index].prompt_tokens]
            )
            oldest = spelled(tokenizer, turns[index - history_turns].observation)
            assert prompt.startswith(f"{IM_START}user\n{instruction}\n\n{oldest}{IM_END}\n")
            current = spelled(tokenizer, turns[index].observation)
            assert prompt.endswith(f"\n{current}{IM_END}\n{IM_START}assistant\n")
            assert prompt.count(f"{IM_START}user") == history_turns + 1
        windowed += len(turns) > history_turns + 1
        assert Trajectory.model_validate_json(trajectory.model_dump_json()) == trajectory
    assert windowed, "a random policy should outlast the window in some of 8 episodes"


async def test_plain_format_stops_at_the_first_action_token(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    stops = set(plain_stop_token_ids(tokenizer, ["Left", "Down", "Right", "Up"]))
    assert len(stops) == 8  # each action, bare and after a space, is one token
    trajectory = await run_episode(
        make_job(FROZENLAKE, 11, max_turns=8), envs, engine, tokenizer, instructions[FROZENLAKE], 0
    )
    replies = [(s, e) for value, s, e in runs(trajectory.loss_mask) if value == 1]
    for start, end in replies:
        inner = trajectory.token_ids[start : end - 1]
        assert not stops & set(inner)  # nothing after an action token was sampled


async def test_bandit_episodes(
    envs: EnvClient,
    engine: EngineClient,
    tokenizer: Any,
    reference_model: Any,
    instructions: dict[str, str],
) -> None:
    before = await instance_ids(envs)
    jobs = [make_job(BANDIT, seed, max_turns=3) for seed in range(8)]
    trajectories = await asyncio.gather(
        *(run_episode(job, envs, engine, tokenizer, instructions[BANDIT], 0) for job in jobs)
    )
    assert await instance_ids(envs) <= before
    for trajectory in trajectories:
        check_aligned(trajectory)
        check_sampled_text(trajectory, tokenizer)
        check_prompt_text(trajectory, tokenizer, instructions[BANDIT])
        check_logprobs(trajectory, reference_model)
        assert trajectory.turns[0].observation.startswith("There are two arms:")
        for turn in trajectory.turns[:-1]:
            assert not turn.done and not turn.valid and turn.reward == 0.0
        last = trajectory.turns[-1]
        if last.done:
            assert last.valid and last.actions[0] in ("Phoenix", "Dragon")
            assert trajectory.success == (last.actions[0] == "Dragon") and not trajectory.truncated
        else:
            assert trajectory.truncated and trajectory.num_turns == 3 and trajectory.reward == 0.0


async def test_same_seed_same_episode(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    job = make_job(FROZENLAKE, 21)
    first = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)
    again = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)
    assert first.token_ids == again.token_ids and first.turns == again.turns
    # The second run reuses cached prompt KV, so log-probs agree to float precision, not bit for bit.
    assert first.logprobs == pytest.approx(again.logprobs, abs=1e-5)


async def test_context_limit_truncates(
    envs: EnvClient,
    engine: EngineClient,
    tokenizer: Any,
    reference_model: Any,
    instructions: dict[str, str],
) -> None:
    before = await instance_ids(envs)
    instruction = instructions[FROZENLAKE]
    created = await envs.create(FROZENLAKE, seed=0)
    await envs.close(created.instance_id)
    prompt = ChatFormat(tokenizer).first_prompt(f"{instruction}\n\n{created.observation}")
    limit = len(prompt) + 3
    truncated = 0
    for seed in range(4):
        job = make_job(
            FROZENLAKE, 0, max_turns=6, sampling=SamplingParams(temperature=TEMPERATURE, seed=seed)
        )
        trajectory = await run_episode(job, envs, engine, tokenizer, instruction, 1, max_model_len=limit)
        # What went to the engine fits; the final observation after it need not (it never goes there).
        assert len(trajectory.token_ids) - tail_length(trajectory) <= limit
        assert trajectory.token_ids[: len(prompt)] == prompt
        assert trajectory.num_turns == 1 and trajectory.turns[0].response_tokens <= 3
        assert trajectory.truncated == (not trajectory.turns[0].done)
        truncated += trajectory.truncated
        check_aligned(trajectory)
        check_sampled_text(trajectory, tokenizer)
        check_logprobs(trajectory, reference_model)
    assert truncated
    # A first prompt that does not fit at all: no turn, truncated, still a valid trajectory.
    job = make_job(FROZENLAKE, 0)
    trajectory = await run_episode(job, envs, engine, tokenizer, instruction, 1, max_model_len=len(prompt))
    assert trajectory.truncated and trajectory.num_turns == 0 and trajectory.token_ids == prompt
    assert set(trajectory.loss_mask) == {0} and trajectory.policy_version == 1
    assert await instance_ids(envs) <= before


async def test_engine_context_limit_also_truncates(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    """Past the engine's own max_model_len (2048) the engine's 400 ends the episode the same way."""
    job = make_job(FROZENLAKE, 1, sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=2048))
    trajectory = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)
    assert trajectory.truncated and trajectory.num_turns == 0
    # The same request straight to the client is a typed error.
    with pytest.raises(EngineContextLengthError):
        await engine.complete(trajectory.token_ids, job.sampling)


async def test_max_turns_ends_the_episode(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    for seed in range(3):
        job = make_job(FROZENLAKE, seed, max_turns=1)
        trajectory = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)
        assert trajectory.num_turns == 1
        assert trajectory.truncated == (not trajectory.turns[0].done)
        check_aligned(trajectory)


async def test_truncated_episode_ends_in_the_state_it_was_cut_in(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    """Cut by max_turns, the context ends with the next observation exactly as the next turn would
    have appended it (closing text, user message, generation prompt; mask 0, log-prob 0.0), so the
    trainer can bootstrap V there; the same episode given one more turn continues from those ids."""
    instruction = instructions[FROZENLAKE]
    checked = 0
    for seed in range(6):
        cut = await run_episode(
            make_job(FROZENLAKE, seed, max_turns=2), envs, engine, tokenizer, instruction, 0
        )
        if not cut.truncated:
            continue  # the env finished within two turns: nothing was cut
        longer = await run_episode(
            make_job(FROZENLAKE, seed, max_turns=3), envs, engine, tokenizer, instruction, 0
        )
        checked += 1
        tail = tail_length(cut)
        assert tail > 0 and cut.num_turns == 2
        assert cut.loss_mask[-tail:] == [0] * tail and cut.logprobs[-tail:] == [0.0] * tail
        # The tail is the third turn's prompt block of the longer episode, token for token.
        assert longer.token_ids[: len(cut.token_ids)] == cut.token_ids
        assert longer.turns[2].prompt_tokens == tail
        assert longer.loss_mask[len(cut.token_ids)] == 1  # the next token was sampled
        assert tokenizer.decode(cut.token_ids[-tail:]).endswith(f"{IM_START}assistant\n")
        check_aligned(cut)
    assert checked, "a random policy should not finish every frozenlake episode in two turns"


async def test_context_limit_keeps_the_observation_that_did_not_fit(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    """Cut by the context limit, the next observation is appended although it does not fit."""
    instruction = instructions[FROZENLAKE]
    created = await envs.create(FROZENLAKE, seed=0)
    await envs.close(created.instance_id)
    prompt = ChatFormat(tokenizer).first_prompt(f"{instruction}\n\n{created.observation}")
    job = make_job(FROZENLAKE, 0, max_turns=6, sampling=SamplingParams(temperature=0.0, max_tokens=1))
    free = await run_episode(job, envs, engine, tokenizer, instruction, 0)
    assert free.num_turns >= 2 and not free.turns[0].done  # greedy: the first step does not finish
    limit = len(prompt) + 1 + free.turns[1].prompt_tokens - 1  # one token short of a second reply
    cut = await run_episode(job, envs, engine, tokenizer, instruction, 0, max_model_len=limit)
    assert cut.truncated and cut.num_turns == 1
    assert len(cut.token_ids) == limit + 1 > limit
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert tail_length(cut) == free.turns[1].prompt_tokens


async def test_answer_tags_penalise_unparsable_replies(
    envs: EnvClient,
    engine: EngineClient,
    tokenizer: Any,
    reference_model: Any,
    instructions: dict[str, str],
    game_server: RunningServer,
) -> None:
    before = await instance_ids(envs)
    job = make_job(
        FROZENLAKE, 5, max_turns=3, action_format="answer_tags", options={"max_actions_per_turn": 2}
    )
    trajectory = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)
    assert await instance_ids(envs) <= before
    check_aligned(trajectory)
    check_sampled_text(trajectory, tokenizer)
    check_logprobs(trajectory, reference_model)
    # A random model writes no tags: every turn is penalised, nothing reaches the env, and the
    # same observation comes back.
    assert trajectory.num_turns == 3 and trajectory.truncated
    first = trajectory.turns[0].observation
    for turn in trajectory.turns:
        assert turn.actions == [] and not turn.valid and turn.reward == FORMAT_PENALTY and not turn.done
        assert turn.observation == first
    assert trajectory.reward == pytest.approx(3 * FORMAT_PENALTY)
    # The format is explained after the env's instruction.
    first_block = tokenizer.decode(trajectory.token_ids[: trajectory.turns[0].prompt_tokens])
    assert instructions[FROZENLAKE] in first_block and "<answer>" in first_block


class ScriptedEngine:
    """Answers with fixed token ids, as an engine would."""

    def __init__(self, tokenizer: Any, reply: str) -> None:
        self.ids = tokenizer.encode(reply, add_special_tokens=False)
        self.text = reply

    async def complete(
        self, prompt_ids: list[int], sampling: SamplingParams, stop_token_ids: Any, **_: Any
    ) -> Completion:
        return Completion(self.ids, [-0.5] * len(self.ids), self.text, "stop")


async def test_answer_tags_actions_reach_the_env(
    envs: EnvClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    """Parsed actions, at most max_actions_per_turn of them, go to the env in one step."""
    created = await envs.create(FROZENLAKE, seed=0)
    await envs.close(created.instance_id)
    engine = ScriptedEngine(tokenizer, "<think>go</think><answer>Down || Down || Down</answer>")
    job = make_job(
        FROZENLAKE, 0, max_turns=1, action_format="answer_tags", options={"max_actions_per_turn": 2}
    )
    trajectory = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)  # type: ignore[arg-type]
    turn = trajectory.turns[0]
    assert turn.actions == ["Down", "Down"] and turn.response == engine.text
    assert turn.valid  # Down is always a legal move (at the edge the player stays)


async def test_words_format_counts_the_actions_the_env_rejected(
    envs: EnvClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    """Each word of a reply is an action; the env host counts the invalid ones for the penalty."""
    engine = ScriptedEngine(tokenizer, "Jump Down Fly")
    job = make_job(FROZENLAKE, 0, max_turns=1, action_format="words", options={"max_actions_per_turn": 3})
    trajectory = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)  # type: ignore[arg-type]
    turn = trajectory.turns[0]
    assert turn.actions == ["Jump", "Down", "Fly"] and not turn.valid
    # Jump is rejected before Down runs; Fly only if Down did not end the episode (a hole).
    assert turn.invalid_actions == (1 if turn.done else 2)
    first_block = tokenizer.decode(trajectory.token_ids[: turn.prompt_tokens])
    assert "Give up to 3 actions, separated by spaces." in first_block


async def test_words_format_with_a_sampling_policy(
    envs: EnvClient, engine: EngineClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    """A random policy's words reach the env, each judged: the count matches the moves among them."""
    moves = {"left", "down", "right", "up"}
    counted = 0
    for seed in range(4):
        job = make_job(
            FROZENLAKE, seed, max_turns=4, action_format="words", options={"max_actions_per_turn": 3}
        )
        trajectory = await run_episode(job, envs, engine, tokenizer, instructions[FROZENLAKE], 0)
        check_aligned(trajectory)
        for turn in trajectory.turns:
            assert turn.actions == (turn.response.split()[:3] or [""])
            if not turn.done:  # every action ran: the env judged each
                assert turn.invalid_actions == sum(a.strip(".'\"").lower() not in moves for a in turn.actions)
                assert turn.valid == (turn.invalid_actions == 0)
                counted += 1
    assert counted


async def test_env_errors_are_typed(envs: EnvClient, engine: EngineClient, tokenizer: Any) -> None:
    with pytest.raises(EpisodeEnvError) as caught:
        await run_episode(make_job("game/nosuchenv", 0), envs, engine, tokenizer, "x", 0)
    assert caught.value.stage == "create" and caught.value.__cause__ is not None


async def test_unreachable_engine_fails_and_still_closes_the_env(
    envs: EnvClient, tokenizer: Any, instructions: dict[str, str]
) -> None:
    before = await instance_ids(envs)
    async with EngineClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01) as dead:
        with pytest.raises(EngineConnectionError):
            await run_episode(make_job(FROZENLAKE, 0), envs, dead, tokenizer, instructions[FROZENLAKE], 0)
    assert await instance_ids(envs) <= before


# -- the engine client on its own ---------------------------------------------------------------


async def test_engine_client_completion_and_admin(engine_server: RunningServer, tokenizer: Any) -> None:
    async with EngineClient(engine_server.url) as client:
        assert await client.max_model_len() == 2048
        prompt = tokenizer.encode("Reach G and avoid O.", add_special_tokens=False)
        sampling = SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=4)
        completion = await client.complete(prompt, sampling, [], max_tokens=5)
        assert 1 <= len(completion.token_ids) == len(completion.logprobs) <= 5
        assert completion.finish_reason in ("stop", "length") and completion.url == engine_server.url
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert (await client.complete(prompt, sampling, [], max_tokens=5)).token_ids == completion.token_ids
        assert client.inflight == {engine_server.url: 0}

        await client.update_weight_version(7)
        assert await client.weight_info() == {engine_server.url: "7"}
        await client.pause("wait")
        await client.resume()
        await client.reload_weights()  # the directory it started with: same samples after
        assert (await client.complete(prompt, sampling, [], max_tokens=5)).token_ids == completion.token_ids
        await client.update_weight_version("default")


async def test_engine_client_load_policy_resumes_on_failure(
    engine_server: RunningServer, tmp_path: Path
) -> None:
    async with EngineClient(engine_server.url) as client:
        with pytest.raises(Exception, match="weights_path"):
            await client.load_policy(str(tmp_path / "missing"), 9)
        paused = await client._request("GET", engine_server.url, "/is_paused")
        assert paused == {"is_paused": False}
        assert (await client.weight_info())[engine_server.url] != "9"


async def test_engine_client_balances_over_servers() -> None:
    urls = ["http://a:1", "http://b:2", "http://c:3/"]
    round_robin = EngineClient(urls, balance="round_robin")
    assert [round_robin.pick() for _ in range(6)] == ["http://a:1", "http://b:2", "http://c:3"] * 2
    least = EngineClient(",".join(urls))
    least.inflight.update({"http://a:1": 2, "http://b:2": 0, "http://c:3": 1})
    assert {least.pick() for _ in range(5)} == {"http://b:2"}
    least.inflight["http://b:2"] = 2
    assert {least.pick() for _ in range(5)} == {"http://c:3"}
    least.inflight["http://c:3"] = 2
    assert {least.pick() for _ in range(6)} == set(least.base_urls)  # ties take turns
    with pytest.raises(ValueError):
        EngineClient([])
    with pytest.raises(ValueError):
        EngineClient(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError):
        EngineClient("http://a:1", balance="random")


def test_completion_request_sends_only_declared_fields() -> None:
    client = EngineClient("http://a:1")
    sampling = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12)
    body = client.completion_request([1, 2], sampling, [5, 3, 5]).model_dump(exclude_unset=True)
    assert body == {
        "prompt": [1, 2],
        "max_tokens": 12,
        "temperature": 0.5,
        "top_p": 0.9,
        "logprobs": 0,
        "return_token_ids": True,
        "stop_token_ids": [3, 5],
    }
    body = (
        EngineClient("http://a:1", model="tiny")
        .completion_request([1], SamplingParams(top_k=5, seed=2), None, max_tokens=3, seed=9)
        .model_dump(exclude_unset=True)
    )
    assert body["model"] == "tiny" and body["top_k"] == 5 and body["seed"] == 9 and body["max_tokens"] == 3
    assert "stop_token_ids" not in body


async def test_engine_client_waits_out_429_and_only_there() -> None:
    """A 429 is retried inside the client (Retry-After honoured, counted) until busy_timeout_s,
    then raised as EngineBusyError; the episode loop above it never retries it again."""
    busy = {"left": 2, "requests": 0}

    async def completions(request: web.Request) -> web.Response:
        busy["requests"] += 1
        if busy["left"]:
            busy["left"] -= 1
            body = {"error": {"code": "engine_full", "message": "full"}}
            return web.json_response(body, status=429, headers={"Retry-After": "0.01"})
        choice = {"index": 0, "text": "Left", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}
        return web.json_response(
            {"model": "m", "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    waits: list[int] = []
    try:
        async with EngineClient(url, backoff_s=0.01, on_busy=lambda: waits.append(1)) as client:
            completion = await client.complete([1], SamplingParams())
            assert completion.token_ids == [7] and completion.busy_wait_s > 0
            assert busy["requests"] == 3 and len(waits) == 2
        busy["left"] = 10**6
        async with EngineClient(url, backoff_s=0.01, busy_timeout_s=0.05) as impatient:
            with pytest.raises(EngineBusyError, match="full"):
                await impatient.complete([1], SamplingParams())
    finally:
        await server.close()
