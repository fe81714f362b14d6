"""Continuous batching in-process: the batch cache's bookkeeping, and batched results equal solo ones."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from deploy.tiny_model import build_model, build_tokenizer
from rollout_server.engine.detokenize import IncrementalText
from rollout_server.engine.kv_cache import BatchKVCache, KVStorage
from rollout_server.engine.prefill import Chunk, forward_chunks, plan_chunks
from rollout_server.engine.sampling import SequenceSampling, penalise
from rollout_server.engine.scheduler import Engine, FinishReason, PauseMode, Sequence
from services.logits import processed_logprobs

TEXTS = ["You are walking on a frozen lake.", "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\nReach G and avoid O."]


@pytest.fixture(scope="module")
def model():
    return build_model(build_tokenizer(TEXTS, ["Left", "Down", "Right", "Up"]), seed=0)


@pytest.fixture
def engine(model):
    engine = Engine(model, max_num_seqs=16, max_model_len=256, eos_token_id=None)
    engine.start()
    yield engine
    engine.stop()


def random_kv(length: int, value: float) -> torch.Tensor:
    """Two layers' KV of one sequence: keys all ``value``, values all ``-value``."""
    return torch.stack([torch.full((1, length, 4), value), torch.full((1, length, 4), -value)]).expand(
        2, -1, -1, -1, -1
    )


def test_cache_rows_keep_their_tokens_through_joins_leaves_and_growth() -> None:
    cache = BatchKVCache(num_layers=2, max_rows=4, max_length=600)
    rows = {}
    for value, length in [(1.0, 3), (2.0, 7), (3.0, 2)]:
        rows[value] = cache.insert(random_kv(length, value))
    assert cache.end == 7
    assert cache.attention_mask().tolist()[2] == [0, 0, 0, 0, 0, 1, 1, 1]
    cache.remove(rows[2.0])  # the longest leaves: row of 3.0 moves into its place, columns compact
    assert cache.rows == 2 and cache.end == 3
    keys, values = cache.extract(1)[0]
    assert keys.shape == (1, 2, 4) and torch.all(keys == 3.0) and torch.all(values == -3.0)
    cache.insert(random_kv(500, 4.0))  # longer than the buffer: the batch shifts right and grows
    assert cache.capacity >= 500 and cache.end == 500
    keys, _ = cache.extract(0)[1]
    assert keys.shape[1] == 3 and torch.all(keys == 1.0)
    assert cache.positions().squeeze(1).tolist() == [3, 2, 500]


def test_a_prefill_cache_right_aligns_each_past_and_leaves_room_for_the_new_tokens() -> None:
    cache = BatchKVCache.right_aligned(2, [random_kv(3, 1.0), None, random_kv(5, 2.0)], width=5, new_tokens=4)
    assert cache.buffer.shape == (2, 2, 3, 1, 9, 4) and cache.end == 5 and cache.rows == 3
    assert cache.lengths.tolist() == [3, 0, 5]
    keys = cache.layers[1].keys[:, 0, :, 0]  # [rows, columns]
    assert keys[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0]  # padding, past, room for the new tokens
    assert keys[1].tolist() == [0] * 9 and keys[2].tolist() == [2] * 5 + [0] * 4
    assert torch.equal(cache.row_kv(2, 0, 5), random_kv(5, 2.0))
    empty = BatchKVCache.right_aligned(2, [None, None], width=0, new_tokens=3)
    assert empty.capacity == 0  # no past to take the shape from: the model's first layer allocates


@torch.inference_mode()  # as the engine thread runs
def test_a_prefill_pass_on_reused_storage_ignores_what_earlier_passes_left_in_its_padding(model) -> None:
    """Padding columns of a reused storage hold stale values, not zeros: the mask must weigh them
    by exactly 0, so a pass on storage full of large values equals a pass on a zeroed buffer."""
    vocab = model.config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(vocab) for _ in range(length)] for length in (40, 9, 25)]
    _, solo = forward_chunks(model, [Chunk(prompts[0], 0, 40, None)])
    past = solo[0].clone()
    chunks = [Chunk(prompts[0], 30, 40, past), Chunk(prompts[1], 0, 9, None), Chunk(prompts[2], 0, 25, None)]
    fresh_logits, fresh_kv = forward_chunks(model, chunks)
    fresh_kv = [kv.clone() for kv in fresh_kv]
    storage = KVStorage()
    storage.take((1 << 16,), past).fill_(1.0e4)  # what an earlier, larger pass could have left
    logits, kv = forward_chunks(model, chunks, storage)
    assert torch.allclose(logits, fresh_logits, atol=1e-5)
    for row, expected in enumerate(fresh_kv):
        assert torch.allclose(kv[row], expected, atol=1e-5)
    kept = storage.take((1,), past).untyped_storage().data_ptr()
    assert kv[1].untyped_storage().data_ptr() == kept  # the pass ran on the stale memory, not a new buffer


def params(seed: int, max_tokens: int) -> SequenceSampling:
    return SequenceSampling(temperature=0.9, top_p=0.95, max_tokens=max_tokens, seed=seed)


def run(engine: Engine, prompts: list[list[int]], seeds: list[int], max_tokens: list[int]) -> list[Sequence]:
    sequences = [
        Sequence(prompt, params(seed, tokens))
        for prompt, seed, tokens in zip(prompts, seeds, max_tokens, strict=True)
    ]
    engine.submit(sequences)
    return [sequence.done.result(timeout=60) for sequence in sequences]


def test_batched_equals_solo_with_ragged_prompts_and_lengths(engine: Engine, model) -> None:
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    max_tokens = [rng.randrange(1, 40) for _ in prompts]
    seeds = list(range(12))
    batched = run(engine, prompts, seeds, max_tokens)
    for index, prompt in enumerate(prompts):
        (solo,) = run(engine, [prompt], [seeds[index]], [max_tokens[index]])
        assert batched[index].output == solo.output
        assert batched[index].logprobs == pytest.approx(solo.logprobs, abs=1e-4)
        assert len(solo.output) == max_tokens[index] and solo.finish_reason is FinishReason.LENGTH


def test_pause_wait_holds_new_work_until_resume(engine: Engine) -> None:
    (first,) = run(engine, [[1, 2, 3]], [0], [5])
    engine.pause(PauseMode.WAIT).result(timeout=60)
    held = Sequence([1, 2, 3], params(0, 5))
    engine.submit([held])
    assert engine.in_flight == 1 and not held.done.done()
    engine.resume()
    assert held.done.result(timeout=60).output == first.output


def test_pause_abort_ends_in_flight_sequences(engine: Engine) -> None:
    long = Sequence([1, 2, 3], params(0, 250))
    engine.submit([long])
    engine.pause(PauseMode.ABORT).result(timeout=60)
    assert long.done.result(timeout=60).finish_reason is FinishReason.ABORT
    assert engine.in_flight == 0
    engine.resume()


def test_multi_turn_prompts_reuse_their_prefix_and_sample_the_same(model) -> None:
    """Turn 2 extends turn 1's prompt and reply: with reuse on, the same tokens and log-probs."""
    results = []
    for cache_bytes in (0, 1 << 24):
        engine = Engine(
            model, max_num_seqs=4, max_model_len=256, eos_token_id=None, prefix_cache_bytes=cache_bytes
        )
        engine.start()
        try:
            first = [list(range(5, 45)), list(range(60, 110))]
            turn_one = run(engine, first, [1, 2], [6, 1])
            second = [prompt + seq.output + [7, 8, 9] for prompt, seq in zip(first, turn_one, strict=True)]
            turn_two = run(engine, second, [3, 4], [6, 6])
            results.append((turn_one + turn_two, engine.stats.reused_prompt_tokens))
        finally:
            engine.stop()
    (plain, no_reuse), (reused, reuse) = results
    assert no_reuse == 0 and reuse >= 32 + 48
    for without, with_reuse in zip(plain, reused, strict=True):
        assert with_reuse.output == without.output
        assert with_reuse.logprobs == pytest.approx(without.logprobs, abs=1e-4)


def other_architecture(name: str):
    """Small random models of other families: grouped KV heads, absolute positions, a sliding window."""
    torch.manual_seed(0)
    if name == "llama":
        config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        return LlamaForCausalLM(config).eval()
    if name == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
        ).eval()
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=24)  # fmt: skip
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral"])
def test_any_causal_lm_batches_exactly(name: str) -> None:
    """Batched log-probs equal ``log_softmax(logits / T)`` of a plain forward pass of the model."""
    model = other_architecture(name)
    engine = Engine(model, max_num_seqs=8, max_model_len=256, eos_token_id=None, prefix_cache_bytes=1 << 24)
    engine.start()
    rng = random.Random(1)
    sequences = [
        Sequence(
            [rng.randrange(300) for _ in range(rng.randrange(3, 50))],
            SequenceSampling(0.9, max_tokens=30, seed=i),
        )
        for i in range(8)
    ]  # 30 new tokens: past mistral's window of 24
    try:
        engine.submit(sequences)
        finished = [sequence.done.result(timeout=60) for sequence in sequences]
    finally:
        engine.stop()
    with torch.no_grad():
        for sequence in finished:
            logits = model(input_ids=torch.tensor([sequence.prompt + sequence.output])).logits[0]
            logprobs = torch.log_softmax(logits / 0.9, dim=-1)
            start = len(sequence.prompt) - 1
            expected = [logprobs[start + i, token].item() for i, token in enumerate(sequence.output)]
            assert sequence.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("name", ["qwen", "mistral"])
def test_batched_chunked_prefill_samples_what_one_prompt_per_pass_does(name: str, model) -> None:
    """Prompts prefilled together, padded, cut into chunks and resumed from cached prefixes give
    the tokens and log-probs of the engine that prefills each prompt whole, in a pass of its own
    (mistral: a sliding window of 24 that chunks and padding must not shift)."""
    policy = model if name == "qwen" else other_architecture(name)
    vocab = policy.config.vocab_size
    rng = random.Random(3)
    first = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 90))] for _ in range(10)]
    results = []
    for prefill_tokens in (None, 40):
        engine = Engine(
            policy,
            max_num_seqs=16,
            max_model_len=256,
            eos_token_id=None,
            prefix_cache_bytes=1 << 24,
            prefill_tokens=prefill_tokens,
        )
        engine.start()
        try:
            turn_one = run(engine, first, list(range(10)), [8] * 10)
            second = [p + s.output + [3, 4, 5] for p, s in zip(first, turn_one, strict=True)]
            turn_two = run(engine, second, list(range(10, 20)), [8] * 10)
            results.append((turn_one + turn_two, engine.stats))
        finally:
            engine.stop()
    (whole, whole_stats), (chunked, chunked_stats) = results
    assert whole_stats.prefill_passes == whole_stats.prefills == 20
    # Passes of at most 40 tokens: prefills spread over more steps, decoding in between.
    assert chunked_stats.prefills == 20 and chunked_stats.steps > whole_stats.steps
    assert chunked_stats.reused_prompt_tokens == whole_stats.reused_prompt_tokens > 0
    for alone, together in zip(whole, chunked, strict=True):
        assert together.output == alone.output
        assert together.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_a_long_prompt_is_prefilled_between_decode_steps(model) -> None:
    """A prompt longer than one pass is prefilled in chunks while a running sequence keeps decoding."""
    engine = Engine(model, max_num_seqs=4, max_model_len=256, eos_token_id=None, prefill_tokens=16)
    engine.start()
    try:
        running = Sequence([1, 2, 3], params(0, 60))
        engine.submit([running])
        long = Sequence(list(range(4, 164)), params(1, 2))  # 160 tokens: 10 passes of 16
        engine.submit([long])
        long.done.result(timeout=60)
        decoded_meanwhile = len(running.output)
        running.done.result(timeout=60)
    finally:
        engine.stop()
    assert engine.stats.prefill_passes >= 11
    assert 10 <= decoded_meanwhile < 60, decoded_meanwhile


@pytest.mark.parametrize(
    ("remaining", "budget", "sizes"),
    [
        ([38, 38, 38], 2048, [38, 38, 38]),
        ([300], 128, [128]),  # a long prompt: its first chunk
        ([10, 300, 10], 128, [10]),  # the long one's chunk would make it 2 x 128: next pass
        ([100, 30, 30, 30], 400, [100, 30, 30, 30]),  # 4 rows x 100 = 400 fits
        ([100, 30, 30, 30, 30], 400, [100, 30, 30, 30]),  # a fifth row would cost 500
    ],
)
def test_plan_chunks_keeps_rows_times_widest_within_budget(
    remaining: list[int], budget: int, sizes: list[int]
) -> None:
    assert plan_chunks(remaining, budget) == sizes


def test_penalties_change_only_the_rows_that_ask(engine: Engine, model) -> None:
    """A row with penalties and a logit bias beside plain rows: the plain rows sample what they
    sample alone; the penalised one reports the log-probs of its penalised distribution."""
    prompt = list(range(5, 25))
    plain = [Sequence(prompt, params(seed, 12)) for seed in (1, 2)]
    asks = dataclasses.replace(
        params(3, 12),
        presence_penalty=0.7,
        frequency_penalty=1.5,
        repetition_penalty=1.3,
        logit_bias=((9, 2.0),),
    )
    penalised = Sequence(prompt, asks)
    engine.submit([plain[0], penalised, plain[1]])
    for sequence in (*plain, penalised):
        sequence.done.result(timeout=60)
    for sequence in plain:
        (alone,) = run(engine, [prompt], [sequence.params.seed], [12])
        assert sequence.output == alone.output
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + penalised.output])).logits[0]
    counts = torch.zeros(logits.shape[1])
    seen = torch.zeros(logits.shape[1], dtype=torch.bool)
    seen[prompt] = True
    bias = torch.zeros(1, logits.shape[1])
    bias[0, 9] = 2.0
    for position, token in enumerate(penalised.output):
        row = penalise(
            logits[len(prompt) - 1 + position].unsqueeze(0),
            counts.unsqueeze(0),
            seen.unsqueeze(0),
            torch.tensor([0.7]),
            torch.tensor([1.5]),
            torch.tensor([1.3]),
            bias,
        )
        logprobs = processed_logprobs(row, torch.tensor([0.9]), torch.tensor([0.95]), torch.tensor([0]))
        assert penalised.logprobs[position] == pytest.approx(logprobs[0, token].item(), abs=1e-4)
        counts[token] += 1


def test_a_stop_string_ends_the_sequence_at_that_step_and_keeps_its_tokens(engine: Engine, model) -> None:
    tokenizer = build_tokenizer(TEXTS, ["Left", "Down", "Right", "Up"])
    prompt = list(range(5, 25))
    (free,) = run(engine, [prompt], [4], [30])
    text = tokenizer.decode(free.output)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    reports: list[tuple[int, str]] = []
    stopped = Sequence(
        prompt,
        dataclasses.replace(params(4, 30), stop=(stop,)),
        text=IncrementalText(tokenizer.decode, (stop,)),
        on_token=lambda sequence: reports.append((len(sequence.output), sequence.text.text)),
    )
    engine.submit([stopped])
    stopped.done.result(timeout=60)
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == stop
    assert stopped.text.text == text[: text.index(stop)]
    assert stopped.output == free.output[: len(stopped.output)]
    assert stop in tokenizer.decode(stopped.output) and stop not in tokenizer.decode(stopped.output[:-1])
    assert [count for count, _ in reports] == list(range(1, len(stopped.output) + 1))
    assert engine.in_flight == 0


def test_top_logprobs_list_the_most_likely_tokens_of_each_step(engine: Engine) -> None:
    sequence = Sequence([1, 2, 3], dataclasses.replace(params(5, 6), top_logprobs=4))
    engine.submit([sequence])
    sequence.done.result(timeout=60)
    assert len(sequence.top_logprobs) == 6
    for top, logprob in zip(sequence.top_logprobs, sequence.logprobs, strict=True):
        values = [value for _, value in top]
        assert len(top) == 4 and values == sorted(values, reverse=True) and values[0] >= logprob
