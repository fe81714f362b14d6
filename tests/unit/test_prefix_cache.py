"""Prompt-prefix reuse: block matching, supersession, eviction by bytes."""

from __future__ import annotations

import torch

from rollout_server.engine.prefix_cache import BLOCK, PrefixCache


def kv_for(tokens: list[int]) -> torch.Tensor:
    """Two layers' KV whose keys are the token ids (values their negatives), so a slice shows
    which tokens it covers."""
    column = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    return torch.stack([torch.stack([column, -column])] * 2)


def test_lookup_returns_the_longest_block_aligned_prefix_leaving_one_token() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20)
    history = list(range(100, 150))  # 50 tokens
    cache.insert(history, kv_for(history))
    length, kv = cache.lookup([*history, 7, 8])
    assert length == len(history) // BLOCK * BLOCK
    assert kv[0][0].flatten().tolist() == history[:length]
    assert kv[1][1].flatten().tolist() == [-t for t in history[:length]]
    assert cache.lookup(history[: 2 * BLOCK])[0] == BLOCK  # one token must stay to be forwarded
    assert cache.lookup([1, *history])[0] == 0
    assert cache.lookup(history[:5])[0] == 0


def test_a_divergent_prompt_reuses_only_the_shared_blocks() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20)
    history = list(range(64))
    cache.insert(history, kv_for(history))
    other = history[:20] + [999] * 40
    assert cache.lookup(other)[0] == 20 // BLOCK * BLOCK


def test_an_extension_supersedes_its_prefix_entry() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20)
    turn_one = list(range(40))
    cache.insert(turn_one, kv_for(turn_one))
    turn_two = [*turn_one, *range(500, 540)]
    cache.insert(turn_two, kv_for(turn_two))
    assert len(cache) == 1
    assert cache.lookup([*turn_two, 1])[0] == 80
    cache.insert(turn_one, kv_for(turn_one))  # already covered: nothing added
    assert len(cache) == 1


def test_least_recently_used_entries_go_first_past_the_budget() -> None:
    entry_bytes = kv_for(list(range(32))).nbytes
    cache = PrefixCache(capacity_bytes=2 * entry_bytes)
    first, second, third = ([base + i for i in range(32)] for base in (0, 1000, 2000))
    cache.insert(first, kv_for(first))
    cache.insert(second, kv_for(second))
    cache.lookup([*first, 1])  # first is now the most recently used
    cache.insert(third, kv_for(third))
    assert cache.bytes_held == 2 * entry_bytes
    assert cache.lookup([*second, 1])[0] == 0
    assert cache.lookup([*first, 1])[0] == 32 and cache.lookup([*third, 1])[0] == 32


def test_shared_prefixes_survive_the_eviction_of_one_holder() -> None:
    entry_bytes = kv_for(list(range(48))).nbytes
    cache = PrefixCache(capacity_bytes=2 * entry_bytes)
    instruction = list(range(32))
    episode_a, episode_b = [*instruction, *range(100, 116)], [*instruction, *range(200, 216)]
    cache.insert(episode_a, kv_for(episode_a))
    cache.insert(episode_b, kv_for(episode_b))
    cache.insert(list(range(900, 948)), kv_for(list(range(900, 948))))  # evicts episode_a
    assert cache.lookup([*instruction, 5, 6])[0] == 32  # still held by episode_b


def test_zero_capacity_keeps_nothing() -> None:
    cache = PrefixCache(capacity_bytes=0)
    tokens = list(range(64))
    cache.insert(tokens, kv_for(tokens))
    assert len(cache) == 0 and cache.lookup([*tokens, 1])[0] == 0
