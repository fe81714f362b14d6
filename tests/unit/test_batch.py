"""trainer/batch.py: collating trajectories into padded tensors and packing micro-batches."""

from __future__ import annotations

import itertools

import pytest
import torch
from synthetic import one_turn_trajectory, synthetic_trajectories

from deploy.model_init import init_tiny_model
from services.policy import load_policy
from services.rollout_protocol import SamplingParams, Trajectory
from trainer.algorithms import logprobs_from_logits
from trainer.algorithms.advantages import LaterSegment
from trainer.batch import PASS_COST_TOKENS, TrainBatch, UntrainableTrajectoryError, collate, micro_batches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = init_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", 0, ["game/frozenlake"], 10, 5)
    model, tokenizer = load_policy(path)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    return model, tokenizer, vocab


@pytest.fixture(scope="module")
def trajectories(tiny) -> list[Trajectory]:
    model, _, vocab = tiny
    return synthetic_trajectories(
        model,
        groups=3,
        group_size=4,
        vocab_ids=vocab,
        first_prompt_len=20,
        observation_len=7,
        turns=(1, 4),
        sampling=SamplingParams(temperature=0.7, max_tokens=4),
        seed=1,
    )


def test_collate_shapes_masks_and_alignment(tiny, trajectories: list[Trajectory]) -> None:
    model, tokenizer, _ = tiny
    batch = collate(trajectories, tokenizer.pad_token_id)
    lengths = [len(t.token_ids) for t in trajectories]
    assert batch.input_ids.shape == (len(trajectories), max(lengths))
    assert batch.lengths.tolist() == lengths
    assert batch.index.tolist() == list(range(len(trajectories)))
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory.token_ids)
        assert batch.input_ids[row, :n].tolist() == trajectory.token_ids
        assert (batch.input_ids[row, n:] == tokenizer.pad_token_id).all()
        assert batch.response_mask[row, :n].tolist() == trajectory.loss_mask
        assert batch.response_mask[row, n:].sum() == 0
        assert batch.scores[row] == trajectory.reward
    assert batch.group_ids[0] == batch.group_ids[3] != batch.group_ids[4]
    # Position t holds log p(token_t | <t): the same convention as logprobs_from_logits.
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    recomputed = logprobs_from_logits(logits, batch.input_ids, temperature=0.7)
    gap = ((recomputed - batch.behaviour_logprobs).abs() * batch.response_mask).max()
    assert gap < 1e-4


def test_each_rows_sampling_and_truncation_travel_with_it(tiny, trajectories: list[Trajectory]) -> None:
    varied = [
        t.model_copy(
            update={
                "sampling": SamplingParams(temperature=0.5 + i / 10, top_p=1.0 - i / 20, top_k=i or None),
                "truncated": i % 3 == 0,
            }
        )
        for i, t in enumerate(trajectories)
    ]
    batch = collate(varied, tiny[1].pad_token_id)
    assert batch.temperature.tolist() == pytest.approx([0.5 + i / 10 for i in range(batch.size)])
    assert batch.top_p.tolist() == pytest.approx([1.0 - i / 20 for i in range(batch.size)])
    assert batch.top_k.tolist() == list(range(batch.size))  # None (no cut) is 0, as the engine's
    assert batch.truncated.tolist() == [i % 3 == 0 for i in range(batch.size)]
    for micro in micro_batches(batch, 40):
        rows = micro.index.tolist()
        assert micro.top_k.tolist() == rows and micro.truncated.tolist() == [r % 3 == 0 for r in rows]
        assert torch.equal(micro.temperature, batch.temperature[micro.index])


def test_collate_keeps_turn_structure(tiny, trajectories: list[Trajectory]) -> None:
    batch = collate(trajectories, tiny[1].pad_token_id)
    assert batch.turn_rewards is not None and batch.turn_end_indices is not None
    for row, trajectory in enumerate(trajectories):
        ends = batch.turn_end_indices[row]
        assert len(ends) == trajectory.num_turns
        assert ends[-1] == len(trajectory.token_ids) - 1
        for end in ends:  # every turn ends on its last sampled token
            assert trajectory.loss_mask[end] == 1
        assert sum(batch.turn_rewards[row]) == pytest.approx(trajectory.reward)


def test_collate_refuses_untrainable(tiny, trajectories: list[Trajectory]) -> None:
    pad = tiny[1].pad_token_id
    failed = trajectories[1].model_copy(update={"error": "env server went away"})
    with pytest.raises(UntrainableTrajectoryError, match=r"trajectory 1 .*env server went away"):
        collate([trajectories[0], failed], pad)
    text_only = Trajectory.model_validate(
        {
            **trajectories[0].model_dump(),
            "token_ids": [],
            "loss_mask": [],
            "logprobs": [],
            "text_only": True,
        }
    )
    with pytest.raises(UntrainableTrajectoryError, match="text-only"):
        collate([text_only], pad)
    with pytest.raises(ValueError):
        collate([], pad)


def _check_partition(batch: TrainBatch, micros: list[TrainBatch], budget: int) -> None:
    seen = sorted(row for micro in micros for row in micro.index.tolist())
    assert seen == list(range(batch.size))
    for micro in micros:
        assert micro.padded_tokens <= budget or micro.size == 1
        assert micro.seq_len == int(micro.lengths.max())
        for local, row in enumerate(micro.index.tolist()):
            n = int(batch.lengths[row])
            assert torch.equal(micro.input_ids[local, :n], batch.input_ids[row, :n])
            assert torch.equal(micro.response_mask[local, :n], batch.response_mask[row, :n])
            assert torch.equal(micro.behaviour_logprobs[local, :n], batch.behaviour_logprobs[row, :n])
            assert micro.group_ids[local] == batch.group_ids[row]
            assert micro.scores[local] == batch.scores[row]


@pytest.mark.parametrize("budget", [1, 40, 100, 250, 10_000])
def test_micro_batches_fit_the_budget_and_recombine(
    tiny, trajectories: list[Trajectory], budget: int
) -> None:
    batch = collate(trajectories, tiny[1].pad_token_id)
    micros = micro_batches(batch, budget)
    _check_partition(batch, micros, budget)
    if budget >= batch.padded_tokens and batch.padded_tokens - batch.num_tokens <= PASS_COST_TOKENS:
        assert len(micros) == 1  # no split can save more padding than a pass costs
    if budget == 1:
        assert len(micros) == batch.size  # each longer sequence on its own
    # Per-row results scatter back to the batch's order.
    full = torch.zeros_like(batch.behaviour_logprobs)
    for micro in micros:
        micro.scatter_rows(full, micro.behaviour_logprobs)
        assert torch.equal(micro.gather_rows(full), micro.behaviour_logprobs)
    assert torch.equal(full, batch.behaviour_logprobs)
    with pytest.raises(ValueError):
        micro_batches(batch, 0)


def _rows_of_lengths(lengths: list[int]) -> TrainBatch:
    """A batch whose rows have ``lengths`` (one trainable token each): all the split looks at."""
    trajectories = [
        one_turn_trajectory([1] * (length - 1), 1, seed=row, group_id=str(row))
        for row, length in enumerate(lengths)
    ]
    return collate(trajectories, 0)


def _cost(micros: list[TrainBatch]) -> int:
    return sum(micro.padded_tokens + PASS_COST_TOKENS for micro in micros)


@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_the_cheapest_cut_of_the_rows_by_length(seed: int) -> None:
    """Exhaustive check: no cut of the length-sorted rows into runs within the budget costs less."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 900, (9,), generator=generator).tolist()
    budget = 2_500
    batch = _rows_of_lengths(lengths)
    micros = micro_batches(batch, budget)
    _check_partition(batch, micros, budget)
    widths = sorted(lengths, reverse=True)
    cheapest = None
    for cuts in itertools.product([False, True], repeat=len(widths) - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), len(widths)]
        runs = [(b - a, widths[a]) for a, b in itertools.pairwise(bounds)]
        if all(rows == 1 or rows * width <= budget for rows, width in runs):
            cost = sum(rows * width + PASS_COST_TOKENS for rows, width in runs)
            cheapest = cost if cheapest is None else min(cheapest, cost)
    assert _cost(micros) == cheapest


def test_short_and_long_episodes_go_to_passes_of_their_own() -> None:
    """The recipe's shape in small: one-turn and eight-turn episodes in one batch that fits the budget."""
    batch = _rows_of_lengths([127] * 40 + [411] * 40)
    assert batch.padded_tokens <= 40_000
    micros = micro_batches(batch, 40_000)
    assert sorted(micro.seq_len for micro in micros) == [127, 411]
    assert sum(micro.padded_tokens for micro in micros) == batch.num_tokens  # no padding left
    same = _rows_of_lengths([300] * 80)
    assert len(micro_batches(same, 40_000)) == 1  # nothing to save: one pass


def test_a_trajectory_with_segments_is_one_row_per_sequence(tiny, trajectories: list[Trajectory]) -> None:
    """An agent that rewrote its history: each sequence its own row, each with the episode's return."""
    episode = next(t for t in trajectories if t.num_turns >= 3)
    ends = list(itertools.accumulate(turn.prompt_tokens + turn.response_tokens for turn in episode.turns))
    split = ends[1]  # the third turn's prompt starts a new sequence
    segmented = episode.model_copy(update={"segments": [split], "reward": 0.75})
    batch = collate([trajectories[0], segmented], tiny[1].pad_token_id)
    assert batch.size == 3 and batch.job_ids == [trajectories[0].job_id, episode.job_id, episode.job_id]
    # The second sequence is in the episode's group, and not counted in its statistics again.
    assert batch.group_ids == [trajectories[0].group_id, episode.group_id, episode.group_id]
    assert [isinstance(key, LaterSegment) for key in batch.group_ids] == [False, False, True]
    for row, (start, end) in zip((1, 2), ((0, split), (split, len(episode.token_ids))), strict=True):
        n = end - start
        assert batch.input_ids[row, :n].tolist() == episode.token_ids[start:end]
        assert batch.response_mask[row, :n].tolist() == episode.loss_mask[start:end]
        assert batch.attention_mask[row].sum() == n and batch.behaviour_logprobs[row, 0] == 0.0
        assert batch.scores[row] == 0.75
    assert batch.turn_end_indices is not None and batch.turn_rewards is not None
    assert batch.turn_end_indices[1] == [ends[0] - 1, ends[1] - 1]
    assert batch.turn_end_indices[2] == [end - split - 1 for end in ends[2:]]
    assert batch.turn_rewards[1][-1] == batch.turn_rewards[2][-1] == 0.75
    assert sum(batch.turn_rewards[1]) == sum(batch.turn_rewards[2]) == 0.75
