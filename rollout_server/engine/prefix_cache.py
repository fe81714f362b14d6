"""KV of finished sequences, reused when a new prompt starts with the same tokens.

A multi-turn episode sends its whole history every turn, and the worker extends token ids
rather than re-tokenising, so turn ``k``'s prompt starts with exactly the tokens of turn
``k - 1`` (its prompt and reply); every episode also starts with the same instruction. Without
reuse, each turn would prefill the whole history again. vLLM does the same (automatic prefix
caching), which is why it has ``/reset_prefix_cache``.

Matching is by blocks of :data:`BLOCK` tokens, each identified by a hash chained over all blocks
before it, so a lookup costs one dict probe per block of the prompt. Entries are evicted least
recently used first, past a memory budget; an entry whose tokens are a prefix of a newer one
is dropped when the newer one arrives (turn ``k`` supersedes turn ``k - 1``). The budget is in
bytes, so the same setting bounds memory for a tiny model and a real one alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_server.engine.kv_cache import SequenceKV

BLOCK = 8


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    kv: SequenceKV
    hashes: list[int]
    nbytes: int


def block_hashes(tokens: Sequence[int], limit: int) -> list[int]:
    """Chained hashes of the full blocks among the first ``limit`` tokens."""
    hashes = []
    chain = 0
    for start in range(0, limit - BLOCK + 1, BLOCK):
        chain = hash((chain, tuple(tokens[start : start + BLOCK])))
        hashes.append(chain)
    return hashes


class PrefixCache:
    """Finished sequences' KV keyed by their tokens; ``capacity_bytes`` 0 turns reuse off."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_held = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # by id(entry), least recent first
        self._index: dict[int, dict[int, Entry]] = {}  # block hash -> entries holding that prefix

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, SequenceKV | None]:
        """The longest cached prefix of ``prompt`` (block-aligned, leaving at least one token to
        forward) as ``(length, its KV)``; ``(0, None)`` when nothing matches."""
        match, blocks = self._longest(prompt, block_hashes(prompt, len(prompt) - 1))
        if match is None:
            return 0, None
        self._entries.move_to_end(id(match))
        length = blocks * BLOCK
        return length, match.kv[..., :length, :]

    def insert(self, tokens: Sequence[int], kv: SequenceKV) -> None:
        """Keep ``kv`` (the KV of ``tokens``, a tensor of its own) for prompts starting with ``tokens``."""
        hashes = block_hashes(tokens, len(tokens))
        nbytes = kv.nbytes
        if not hashes or nbytes > self.capacity_bytes:
            return
        covering, blocks = self._longest(tokens, hashes)
        if covering is not None and blocks == len(hashes):
            self._entries.move_to_end(id(covering))  # nothing new to keep
            return
        if covering is not None and blocks == len(covering.hashes):
            self._drop(covering)  # the new entry extends it
        entry = Entry(tuple(tokens), kv, hashes, nbytes)
        self._entries[id(entry)] = entry
        self.bytes_held += nbytes
        for chain in hashes:
            self._index.setdefault(chain, {})[id(entry)] = entry
        while self.bytes_held > self.capacity_bytes:
            self._drop(next(iter(self._entries.values())))

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.bytes_held = 0

    def _longest(self, tokens: Sequence[int], hashes: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the most full blocks with ``tokens``, and how many blocks.

        ``hashes``: the chained block hashes of (a prefix of) ``tokens``. An entry holding block
        ``k``'s hash holds the blocks before it too (the hash covers them), so the longest match is
        the last hash found: probed from the end, where the previous turn's entry ends, a few
        blocks before the prompt's, instead of from the start (25-40 blocks a FrozenLake turn).
        """
        for blocks in range(len(hashes), 0, -1):
            holders = self._index.get(hashes[blocks - 1])
            if holders:
                found = next(reversed(holders.values()))
                break
        else:
            return None, 0
        # A hash collision would splice another sequence's KV in: check the tokens themselves.
        if found.tokens[: blocks * BLOCK] != tuple(tokens[: blocks * BLOCK]):
            return None, 0
        return found, blocks

    def _drop(self, entry: Entry) -> None:
        del self._entries[id(entry)]
        self.bytes_held -= entry.nbytes
        for chain in entry.hashes:
            holders = self._index[chain]
            del holders[id(entry)]
            if not holders:
                del self._index[chain]
