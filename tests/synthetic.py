"""Multi-turn trajectories sampled from a model in-process, for the trainer's tests and benchmark.

The tokens are drawn by the CPU engine's own sampler (:func:`rollout_server.engine.sampling.sample`),
so temperature, top-k and top-p act as they do in a real rollout and the behaviour log-probs are
the engine's processed log-probs, without starting the rollout side.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from rollout_server.engine.sampling import sample
from services.rollout_protocol import SamplingParams, Trajectory, Turn

RewardFn = Callable[[list[list[int]], random.Random], float]
"""``reward_fn(responses, rng)``: the episode's return from its sampled responses (one token list
per turn)."""


def one_turn_trajectory(
    prompt: list[int], reply: int, *, seed: int = 0, group_id: str = "group"
) -> Trajectory:
    """A one-turn FrozenLake trajectory of exactly these tokens: ``prompt`` (mask 0), then ``reply``
    sampled (log-prob -1): for tests of what reads a trajectory's tokens, not how they were played."""
    return Trajectory(
        run_id="run",
        env="game/frozenlake",
        seed=seed,
        group_id=group_id,
        max_turns=8,
        policy_version=0,
        worker_id="worker",
        turns=[
            Turn(
                observation="",
                response="",
                reward=0.0,
                done=True,
                valid=False,
                policy_version=0,
                prompt_tokens=len(prompt),
                response_tokens=1,
            )
        ],
        num_turns=1,
        token_ids=[*prompt, reply],
        loss_mask=[0] * len(prompt) + [1],
        logprobs=[0.0] * len(prompt) + [-1.0],
    )


def _default_reward(responses: list[list[int]], rng: random.Random) -> float:
    return float(rng.random() < 0.3)


@torch.no_grad()
def synthetic_trajectories(
    model: torch.nn.Module,
    *,
    groups: int,
    group_size: int,
    vocab_ids: Sequence[int],
    first_prompt_len: int = 125,
    observation_len: int = 33,
    turns: tuple[int, int] = (1, 8),
    sampling: SamplingParams | None = None,
    stop_token_ids: Sequence[int] = (),
    reward_fn: RewardFn = _default_reward,
    seed: int = 0,
    env: str = "synthetic/sampled",
    run_id: str = "synthetic",
    policy_version: int = 0,
) -> list[Trajectory]:
    """Multi-turn trajectories sampled from ``model`` (a causal LM) with real behaviour log-probs.

    Each group shares its first prompt (``first_prompt_len`` random tokens from ``vocab_ids``),
    as episodes from one initial state do; each episode plays a random number of turns in
    ``turns`` (inclusive): an observation of ``observation_len`` random tokens (none before the
    first turn), then up to ``sampling.max_tokens`` tokens sampled with ``sampling``'s
    temperature, top-k and top-p by the engine's sampler, with a KV cache, ending early at a
    ``stop_token_ids`` token. The last turn carries ``reward_fn(responses, rng)``; the episode
    return is it.
    """
    from transformers import DynamicCache

    sampling = sampling or SamplingParams(max_tokens=8)
    temperature = torch.tensor([sampling.temperature])
    top_p = torch.tensor([sampling.top_p])
    top_k = torch.tensor([sampling.top_k or 0])
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    stops = set(stop_token_ids)
    vocab = list(vocab_ids)
    was_training = model.training
    model.eval()
    trajectories: list[Trajectory] = []
    for group in range(groups):
        first_prompt = [rng.choice(vocab) for _ in range(first_prompt_len)]
        for member in range(group_size):
            num_turns = rng.randint(turns[0], turns[1])
            cache = DynamicCache()
            token_ids: list[int] = []
            loss_mask: list[int] = []
            logprobs: list[float] = []
            turn_records: list[Turn] = []
            responses: list[list[int]] = []
            carry: list[int] = []
            for turn in range(num_turns):
                prompt = first_prompt if turn == 0 else [rng.choice(vocab) for _ in range(observation_len)]
                # The previous turn's last sampled token is in the context but not yet in the cache.
                pending = carry + list(prompt)
                response: list[int] = []
                for _ in range(sampling.max_tokens):
                    out = model(
                        input_ids=torch.tensor([pending], device=device),
                        past_key_values=cache,
                        use_cache=True,
                    )
                    cache = out.past_key_values
                    logits = out.logits[:, -1].float().cpu()
                    uniform = torch.rand(1, generator=generator)
                    tokens, token_logprobs = sample(logits, temperature, top_p, top_k, uniform)
                    token = int(tokens[0])
                    if not response:
                        token_ids += prompt
                        loss_mask += [0] * len(prompt)
                        logprobs += [0.0] * len(prompt)
                    token_ids.append(token)
                    loss_mask.append(1)
                    logprobs.append(float(token_logprobs[0]))
                    response.append(token)
                    pending = [token]
                    if token in stops:
                        break
                carry = [response[-1]]
                responses.append(response)
                turn_records.append(
                    Turn(
                        observation=f"obs {turn}",
                        response=" ".join(map(str, response)),
                        actions=[],
                        reward=0.0,
                        done=turn == num_turns - 1,
                        valid=True,
                        policy_version=policy_version,
                        prompt_tokens=len(prompt),
                        response_tokens=len(response),
                    )
                )
            reward = float(reward_fn(responses, rng))
            turn_records[-1] = turn_records[-1].model_copy(update={"reward": reward})
            trajectories.append(
                Trajectory(
                    job_id=f"{run_id}-{seed}-{group}-{member}",
                    run_id=run_id,
                    env=env,
                    seed=group,
                    group_id=f"{run_id}-{seed}-g{group}",
                    max_turns=max(turns[1], 1),
                    sampling=sampling,
                    policy_version=policy_version,
                    turns=turn_records,
                    token_ids=token_ids,
                    loss_mask=loss_mask,
                    logprobs=logprobs,
                    reward=reward,
                    success=reward > 0,
                    num_turns=len(turn_records),
                    worker_id="synthetic",
                )
            )
    model.train(was_training)
    return trajectories
