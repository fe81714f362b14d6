"""Trajectories to padded tensors, and padded tensors to micro-batches that fit a token budget.

:func:`collate` turns a list of :class:`~services.rollout_protocol.Trajectory` into one
:class:`TrainBatch`: every token-level field ``[B, S]`` right-padded to the longest episode, with
the conventions of :mod:`trainer.algorithms` (``response_mask`` is the trajectories' ``loss_mask``;
``behaviour_logprobs[:, t]`` is the behaviour log-prob of token ``t`` given the tokens before it,
as :func:`~trainer.algorithms.losses.logprobs_from_logits` computes it; 0 off the mask).

:func:`micro_batches` splits a batch into pieces whose padded size ``rows x columns`` stays within
a token budget, each trimmed to its own longest row; ``TrainBatch.index`` maps each row back to
its row in the batch it came from, so per-row results can be put back together
(:meth:`TrainBatch.scatter_rows`).

:func:`synthetic_trajectories` samples multi-turn trajectories from a model in-process, with real
behaviour log-probs, for tests, benchmarks and dry runs without the rollout side.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from services.rollout_protocol import SamplingParams, Trajectory, Turn


class UntrainableTrajectoryError(ValueError):
    """A trajectory the trainer must not learn from (text-only, failed) was passed to :func:`collate`."""


@dataclass
class TrainBatch:
    """Padded ``[B, S]`` tensors of whole episodes (one per row, right padding) and per-row data.

    input_ids: ``[B, S]`` long, the exact sampled context; ``pad_token_id`` past each row's end.
    attention_mask: ``[B, S]`` long, 1 on real tokens.
    response_mask: ``[B, S]`` float32, 1 on trainable (sampled assistant) tokens: the ``loss_mask``.
    behaviour_logprobs: ``[B, S]`` float32, position ``t`` holds log pi_behaviour(token_t | <t);
        0 off the mask.
    scores: ``[B]`` float32, the episode return (``Trajectory.reward``).
    index: ``[B]`` long, each row's position in the batch it was cut from (``arange`` for a
        collated batch).
    group_ids, env_ids, job_ids, policy_versions: per row.
    turn_rewards / turn_end_indices: per row, each turn's reward and the index of its last token
        (``place_rewards``'s arguments); None when the trajectories carry no turn structure that
        fits their tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    scores: torch.Tensor
    index: torch.Tensor
    group_ids: list[str]
    env_ids: list[str]
    job_ids: list[str]
    policy_versions: list[int]
    turn_rewards: list[list[float]] | None = None
    turn_end_indices: list[list[int]] | None = None

    @property
    def size(self) -> int:
        """Rows (episodes) ``B``."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Padded length ``S``."""
        return int(self.input_ids.shape[1])

    @property
    def padded_tokens(self) -> int:
        """``B x S``: what the budget of :func:`micro_batches` counts."""
        return self.size * self.seq_len

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return int(self.attention_mask.sum())

    @property
    def num_trainable_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` long: each row's unpadded length."""
        return self.attention_mask.sum(dim=1)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with its tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def select(self, rows: Sequence[int], seq_len: int | None = None) -> TrainBatch:
        """Rows ``rows`` (in that order), columns ``[:seq_len]`` (default: the longest selected row).

        ``index`` of the result holds the selected rows' ``index`` values, so it still points into
        the original collated batch.
        """
        if not rows:
            raise ValueError("select needs at least one row")
        picked = torch.as_tensor(list(rows), dtype=torch.long, device=self.input_ids.device)
        if seq_len is None:
            seq_len = int(self.attention_mask[picked].sum(dim=1).max())
        seq_len = max(1, seq_len)

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            return tensor[picked, :seq_len].contiguous()

        return TrainBatch(
            input_ids=cut(self.input_ids),
            attention_mask=cut(self.attention_mask),
            response_mask=cut(self.response_mask),
            behaviour_logprobs=cut(self.behaviour_logprobs),
            scores=self.scores[picked],
            index=self.index[picked],
            group_ids=[self.group_ids[row] for row in rows],
            env_ids=[self.env_ids[row] for row in rows],
            job_ids=[self.job_ids[row] for row in rows],
            policy_versions=[self.policy_versions[row] for row in rows],
            turn_rewards=None if self.turn_rewards is None else [self.turn_rewards[row] for row in rows],
            turn_end_indices=(
                None if self.turn_end_indices is None else [self.turn_end_indices[row] for row in rows]
            ),
        )

    def scatter_rows(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Write this micro-batch's per-row ``values`` (``[b]`` or ``[b, s]``) into ``full``
        (``[B]`` or ``[B, S]`` of the batch it was cut from), at the rows ``index`` names."""
        if values.dim() == 1:
            full[self.index] = values.to(full.dtype)
        else:
            full[self.index, : values.shape[1]] = values.to(full.dtype)

    def gather_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This micro-batch's rows of a ``[B]`` or ``[B, S]`` tensor of the batch it was cut from,
        trimmed to this micro-batch's length: the inverse of :meth:`scatter_rows`."""
        rows = full[self.index]
        return rows if rows.dim() == 1 else rows[:, : self.seq_len]


def _turn_structure(trajectory: Trajectory) -> tuple[list[float], list[int]] | None:
    """Each turn's reward and last-token index, or None if the turns do not tile the tokens.

    The episode runner appends, per turn, ``prompt_tokens`` (observation, template) then
    ``response_tokens`` sampled tokens, so turn ``i`` ends at ``sum(prompt + response)[: i+1] - 1``.
    A turn with no trainable token at or before its end (a first turn that sampled nothing) has
    its end moved to the first trainable token, so its reward is kept, not an error.
    """
    if not trajectory.turns:
        return None
    ends: list[int] = []
    position = 0
    for turn in trajectory.turns:
        position += turn.prompt_tokens + turn.response_tokens
        ends.append(position - 1)
    if position > len(trajectory.token_ids) or position <= 0:
        return None
    first_trainable = next((i for i, m in enumerate(trajectory.loss_mask) if m), None)
    if first_trainable is None:
        return None
    ends = [max(end, first_trainable) for end in ends]
    return [float(turn.reward) for turn in trajectory.turns], ends


def collate(trajectories: Sequence[Trajectory], pad_token_id: int) -> TrainBatch:
    """Pad ``trajectories`` (right padding with ``pad_token_id``) into one :class:`TrainBatch`.

    Raises :class:`UntrainableTrajectoryError` naming the first trajectory that is not
    ``trainable`` (text-only, failed) or has no trainable token; the caller filters those out
    (and counts them) before collating. Per-turn rewards are kept when every trajectory's turns
    tile its tokens (see :func:`_turn_structure`), else ``turn_rewards`` is None.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    for position, trajectory in enumerate(trajectories):
        reason = trajectory.untrainable_reason
        if reason is None and not any(trajectory.loss_mask):
            reason = "no trainable token (empty loss_mask)"
        if reason is not None:
            raise UntrainableTrajectoryError(
                f"trajectory {position} (job {trajectory.job_id}) is not trainable: {reason}; "
                "filter with `Trajectory.trainable` before collating"
            )
    batch = len(trajectories)
    seq_len = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((batch, seq_len), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    response_mask = torch.zeros(batch, seq_len, dtype=torch.float32)
    behaviour = torch.zeros(batch, seq_len, dtype=torch.float32)
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory.token_ids)
        input_ids[row, :n] = torch.tensor(trajectory.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        response_mask[row, :n] = torch.tensor(trajectory.loss_mask, dtype=torch.float32)
        behaviour[row, :n] = torch.tensor(trajectory.logprobs, dtype=torch.float32)
    if response_mask[:, 0].any():
        raise UntrainableTrajectoryError("token 0 of an episode cannot be trainable: nothing predicts it")
    structures = [_turn_structure(t) for t in trajectories]
    has_turns = all(s is not None for s in structures)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logprobs=behaviour,
        scores=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
        index=torch.arange(batch, dtype=torch.long),
        group_ids=[t.group_id for t in trajectories],
        env_ids=[t.env for t in trajectories],
        job_ids=[t.job_id for t in trajectories],
        policy_versions=[t.policy_version for t in trajectories],
        turn_rewards=[s[0] for s in structures] if has_turns else None,  # type: ignore[index]
        turn_end_indices=[s[1] for s in structures] if has_turns else None,  # type: ignore[index]
    )


def micro_batches(batch: TrainBatch, token_budget: int) -> list[TrainBatch]:
    """Split ``batch`` into micro-batches of at most ``token_budget`` padded tokens (rows x length).

    Greedy packing: rows sorted by length, longest first; a micro-batch takes rows while
    ``rows x (its longest row)`` stays within the budget. A row longer than the budget forms a
    micro-batch of its own. Each micro-batch is trimmed to its longest row, and its ``index``
    holds the positions of its rows in ``batch`` (through ``batch.index``, so indices refer to the
    collated batch): every row appears in exactly one micro-batch.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    lengths = batch.lengths.tolist()
    order = sorted(range(batch.size), key=lambda row: (-lengths[row], row))
    groups: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for row in order:
        row_len = max(1, lengths[row])
        width = max(current_len, row_len)
        if current and (len(current) + 1) * width > token_budget:
            groups.append(current)
            current, current_len = [], 0
            width = row_len
        current.append(row)
        current_len = width
    if current:
        groups.append(current)
    return [batch.select(rows, max(1, max(lengths[row] for row in rows))) for rows in groups]


# --------------------------------------------------------------------------------------------
# Synthetic trajectories sampled from a model in-process
# --------------------------------------------------------------------------------------------


RewardFn = Callable[[list[list[int]], random.Random], float]
"""``reward_fn(responses, rng)``: the episode's return from its sampled responses (one token list
per turn)."""


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
    first turn), then up to ``sampling.max_tokens`` tokens sampled at ``sampling.temperature``
    (full vocabulary, no top-p/top-k) with a KV cache, ending early at a ``stop_token_ids`` token.
    Behaviour log-probs are ``log_softmax(logits / T)`` of the sampled tokens, as the engine
    reports them. The last turn carries ``reward_fn(responses, rng)``; the episode return is it.
    """
    from transformers import DynamicCache

    sampling = sampling or SamplingParams(max_tokens=8)
    temperature = sampling.temperature
    greedy = temperature < 1e-5
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
                    logits = out.logits[0, -1].float().cpu()
                    scaled = logits if greedy or temperature == 1.0 else logits / temperature
                    log_probs = torch.log_softmax(scaled, dim=-1)
                    if greedy:
                        token = int(torch.argmax(log_probs))
                    else:
                        token = int(torch.multinomial(log_probs.exp(), 1, generator=generator))
                    if not response:
                        token_ids += prompt
                        loss_mask += [0] * len(prompt)
                        logprobs += [0.0] * len(prompt)
                    token_ids.append(token)
                    loss_mask.append(1)
                    logprobs.append(float(log_probs[token]))
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
