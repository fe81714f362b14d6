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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from services.rollout_protocol import Trajectory
from trainer.algorithms.advantages import LaterSegment


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
    temperature, top_p: ``[B]`` float32; top_k: ``[B]`` long, 0 for no cut: how each row was
        sampled (``Trajectory.sampling``), so the trainer recomputes its log-probs under the same
        truncation the engine sampled with.
    truncated: ``[B]`` bool, the episode was cut by ``max_turns`` or the context limit, not ended
        by the env (``Trajectory.truncated``): GAE bootstraps it from the critic. Its tokens after
        the last sampled one are the final observation (mask 0), so the state it was cut in is
        the one after its last real token.
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
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    truncated: torch.Tensor
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
            temperature=self.temperature[picked],
            top_p=self.top_p[picked],
            top_k=self.top_k[picked],
            truncated=self.truncated[picked],
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


@dataclass(frozen=True, slots=True)
class _Row:
    """One row of a batch: a trajectory's tokens ``[start, end)`` and its turn structure there."""

    trajectory: Trajectory
    start: int
    end: int
    turns: tuple[list[float], list[int]] | None


def _rows(trajectory: Trajectory) -> list[_Row]:
    """One row per sequence of ``trajectory``: the whole episode, or each of its ``segments``.

    An agent that rewrote its history made a new sequence (``Trajectory.segments``): the model
    sampled its replies after that sequence's own prompt, never after the tokens before it, so
    it is trained as its own row. Every row carries the episode's return, on its last turn.
    """
    bounds = [0, *trajectory.segments, len(trajectory.token_ids)]
    structure = _turn_structure(trajectory)
    if len(bounds) == 2:
        return [_Row(trajectory, 0, bounds[1], structure)]
    rows = []
    for start, end in itertools.pairwise(bounds):
        turns = None
        if structure is not None:
            ends = [index - start for index in structure[1] if start <= index < end]
            turns = ([0.0] * (len(ends) - 1) + [float(trajectory.reward)], ends) if ends else None
        rows.append(_Row(trajectory, start, end, turns))
    return rows


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
    tile its tokens (see :func:`_turn_structure`), else ``turn_rewards`` is None. A trajectory
    with ``segments`` gives one row per sequence (see :func:`_rows`), each with the episode's
    return; the rows after its first have their group id as a
    :class:`~trainer.algorithms.advantages.LaterSegment`, so group baselines count the episode once.
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
    rows = [row for trajectory in trajectories for row in _rows(trajectory)]
    batch = len(rows)
    seq_len = max(row.end - row.start for row in rows)
    input_ids = torch.full((batch, seq_len), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    response_mask = torch.zeros(batch, seq_len, dtype=torch.float32)
    behaviour = torch.zeros(batch, seq_len, dtype=torch.float32)
    for index, row in enumerate(rows):
        n, span, trajectory = row.end - row.start, slice(row.start, row.end), row.trajectory
        input_ids[index, :n] = torch.tensor(trajectory.token_ids[span], dtype=torch.long)
        attention_mask[index, :n] = 1
        response_mask[index, :n] = torch.tensor(trajectory.loss_mask[span], dtype=torch.float32)
        behaviour[index, :n] = torch.tensor(trajectory.logprobs[span], dtype=torch.float32)
    if response_mask[:, 0].any():
        raise UntrainableTrajectoryError("token 0 of an episode cannot be trainable: nothing predicts it")
    has_turns = all(row.turns is not None for row in rows)
    episodes = [row.trajectory for row in rows]
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logprobs=behaviour,
        scores=torch.tensor([float(t.reward) for t in episodes], dtype=torch.float32),
        temperature=torch.tensor([t.sampling.temperature for t in episodes], dtype=torch.float32),
        top_p=torch.tensor([t.sampling.top_p for t in episodes], dtype=torch.float32),
        top_k=torch.tensor([t.sampling.top_k or 0 for t in episodes], dtype=torch.long),
        truncated=torch.tensor([t.truncated for t in episodes], dtype=torch.bool),
        index=torch.arange(batch, dtype=torch.long),
        group_ids=[
            row.trajectory.group_id if row.start == 0 else LaterSegment(row.trajectory.group_id)
            for row in rows
        ],
        env_ids=[t.env for t in episodes],
        job_ids=[t.job_id for t in episodes],
        policy_versions=[t.policy_version for t in episodes],
        turn_rewards=[row.turns[0] for row in rows] if has_turns else None,  # type: ignore[index]
        turn_end_indices=[row.turns[1] for row in rows] if has_turns else None,  # type: ignore[index]
    )


PASS_COST_TOKENS = 384
"""What one more micro-batch costs, in padded tokens: the price :func:`micro_batches` weighs a
split against the padding it saves. Measured on a recorded FrozenLake batch of the recipe (128
episodes of 1-8 turns, 31.5k tokens, rows 127-411 long; the tiny policy, one thread): an update
took 0.59 s split at a cost of 250, 0.60 s at 500, 0.66 s at 1,000, and 1.60 s with no cost (a pass
per row), against 1.15 s for the longest-first greedy fill of a 32k budget (2 passes, 40k padded
tokens) this replaced and 0.65 s for that fill of an 8k budget (5 passes)."""


def micro_batches(batch: TrainBatch, token_budget: int) -> list[TrainBatch]:
    """Split ``batch`` into micro-batches of at most ``token_budget`` padded tokens (rows x length),
    with as little padding as the passes it takes are worth.

    Rows are sorted by length, longest first, and cut into runs: a run is one micro-batch, padded
    to its first (longest) row. Of all such cuts whose runs fit the budget, the one with the fewest
    padded tokens plus :data:`PASS_COST_TOKENS` per run is taken (dynamic programming over the
    cut points, exact). Why not fill the budget: a multi-turn batch's rows range from one turn to
    eight (127 to 411 tokens in the recipe), and one 32k micro-batch padded its 79 longest rows to
    the longest, 1.29x the real tokens; attention, quadratic in the padded length, paid more than
    that (the update 1.15 s against 0.59 s). A row longer than the budget forms a micro-batch of
    its own. Each micro-batch is trimmed to its longest row, and its ``index`` holds the positions
    of its rows in ``batch`` (through ``batch.index``, so indices refer to the collated batch):
    every row appears in exactly one micro-batch. The split changes no result: the loss is summed
    over micro-batches against the whole batch's denominator.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    lengths = [max(1, length) for length in batch.lengths.tolist()]
    order = sorted(range(batch.size), key=lambda row: (-lengths[row], row))
    widths = [lengths[row] for row in order]
    # cost[j]: the cheapest cut of the j longest rows; start[j]: where its last run starts.
    cost = [0] * (len(order) + 1)
    start = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        best = None
        for first in range(end - 1, -1, -1):  # the run order[first:end], padded to widths[first]
            rows = end - first
            if rows > 1 and rows * widths[first] > token_budget:
                break  # a longer run is wider and has more rows: no earlier start fits either
            candidate = cost[first] + rows * widths[first] + PASS_COST_TOKENS
            if best is None or candidate <= best:  # a tie goes to the longer run: fewer passes
                best, start[end] = candidate, first
        assert best is not None  # a run of one row always fits
        cost[end] = best
    runs: list[list[int]] = []
    end = len(order)
    while end > 0:
        runs.append(order[start[end] : end])
        end = start[end]
    return [batch.select(rows, lengths[rows[0]]) for rows in reversed(runs)]
