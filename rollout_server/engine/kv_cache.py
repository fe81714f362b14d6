"""The KV cache of the running batch: one preallocated buffer for all layers, sequences aligned at the end.

Layout: one tensor ``[layers, 2, max_rows, kv_heads, capacity, head_dim]`` (keys then values), of
which each layer sees its ``[max_rows, kv_heads, capacity, head_dim]`` slices. Rows
``0..rows-1`` are the running sequences; columns ``0..end-1`` hold data, and the sequence in
row ``r`` occupies the last ``lengths[r]`` of them (left padding, as ``generate()`` pads a batch).
So every row writes its next token into the same column ``end``: a decode step is one slice
write per layer, where ``DynamicCache`` would copy the whole cache with ``torch.cat``. Keeping
each sequence contiguous lets Hugging Face build its own masks as for any left-padded batch
(positions are passed explicitly): the model code is used unchanged, whatever the architecture.

A sequence's KV outside the batch (:data:`SequenceKV`) has the same layout for one row, so a
sequence joins, leaves, is copied into the prefix cache or shifted with the batch in one tensor
copy whatever the number of layers, where per-layer keys and values took ``2 x layers`` copies,
each a GIL hand-off from the engine thread to the HTTP thread: the clones alone were 9% of the
engine server's samples in a FrozenLake rollout (``bench/rollout.py --profile``).

Sequences join with their prefilled KV (right-aligned at ``end``; the batch shifts right when the
newcomer is longer than ``end``) and leave by moving the last row into their place. Leading
columns that no row uses any more are dropped when they waste a quarter of the width, and the
buffer grows by doubling up to the maximum model length, so memory is bounded by
``max_rows * max_model_len`` tokens. Every layer's KV has the first layer's shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

SequenceKV = torch.Tensor
"""One sequence's keys and values in every layer: ``[layers, 2, kv_heads, length, head_dim]``."""
INITIAL_CAPACITY = 256


class KVStorage:
    """Memory that caches living one after another carve their buffer from: the prefill passes'.

    A prefill pass's cache is as large as its rows times its widest past (16 MB for 53 rows of 300
    tokens of the tiny policy), and zeroing a fresh one for every pass was 8.7% of the engine
    server's samples in a FrozenLake rollout (``bench/rollout.py --profile``), as much as copying
    the pasts in. Kept from pass to pass, the memory is zeroed once, when it grows; after that a
    padding column holds whatever an earlier pass computed there, finite values that the
    attention mask weighs by exactly 0 (only uninitialised memory could hold a NaN, and 0 x NaN
    is NaN). The price is that a cache's buffer is valid until the next cache takes the storage,
    and that the storage stays as large as the largest pass so far.
    """

    def __init__(self) -> None:
        self._memory = torch.empty(0)

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``like``'s dtype and device, over the kept memory."""
        size = math.prod(shape)
        memory = self._memory
        if memory.numel() < size or memory.dtype != like.dtype or memory.device != like.device:
            # A quarter more than asked: a batch whose widest past grows by a few tokens a turn
            # would otherwise zero a new buffer every pass.
            memory = torch.zeros(size + size // 4, dtype=like.dtype, device=like.device)
            self._memory = memory
        return memory[:size].view(shape)


class SlabLayer(CacheLayerMixin):
    """One model layer's view of the shared slab; the model calls :meth:`update` during forward."""

    is_sliding = False

    def __init__(self, slab: BatchKVCache) -> None:
        super().__init__()
        self.slab = slab

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A forward pass before any sequence joined: the buffer takes the model's KV shape, as
        wide as the cache may grow (:meth:`BatchKVCache.right_aligned` with no past)."""
        self.slab.allocate(key_states, self.slab.max_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, end = self.slab.rows, self.slab.end
        width = key_states.shape[-2]
        self.keys[:rows, :, end : end + width] = key_states
        self.values[:rows, :, end : end + width] = value_states
        return self.keys[:rows, :, : end + width], self.values[:rows, :, : end + width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slab.end + query_length, 0

    def get_seq_length(self) -> int:
        return self.slab.end

    def get_max_length(self) -> int:
        return -1


class BatchKVCache(Cache):
    """The running sequences' KV, passed to the model as ``past_key_values`` for each decode step.

    After a forward pass over ``q`` new tokens per row the caller calls :meth:`advance` with ``q``.
    """

    def __init__(
        self, num_layers: int, max_rows: int, max_length: int, storage: KVStorage | None = None
    ) -> None:
        super().__init__(layers=[SlabLayer(self) for _ in range(num_layers)])
        self.storage = storage  # where the buffer is carved from; None: a zeroed buffer of its own
        self.max_rows = max_rows
        self.max_length = max_length
        self.rows = 0
        self.end = 0
        self.lengths = torch.zeros(max_rows, dtype=torch.long)
        self.capacity = 0
        self.buffer = torch.empty(0)  # [layers, 2, max_rows, kv_heads, capacity, head_dim] once allocated

    @classmethod
    def right_aligned(
        cls,
        num_layers: int,
        pasts: Sequence[SequenceKV | None],
        width: int,
        new_tokens: int,
        storage: KVStorage | None = None,
    ) -> BatchKVCache:
        """A cache of ``len(pasts)`` rows, each row's past ending at column ``width``, with room for
        exactly ``new_tokens`` more: what a batched prefill pass feeds the model.

        ``pasts``: per row its KV (``length <= width``) or ``None`` for a row with no past. The
        model's forward writes the new tokens' KV after column ``width`` in place; a
        ``DynamicCache`` would concatenate them to the past instead, a copy of the whole batch's
        KV per layer (10% of the engine thread in a FrozenLake rollout, 128 rows of ~40 new
        tokens). With no past at all the buffer is allocated by the forward's first layer. The
        buffer comes from ``storage`` when one is given (its padding then holds stale values).
        """
        cache = cls(num_layers, len(pasts), width + new_tokens, storage)
        like = next((kv for kv in pasts if kv is not None), None)
        if like is not None:
            cache.allocate(like, width + new_tokens)
        for row, kv in enumerate(pasts):
            if kv is None:
                continue  # its columns are padding, masked out
            length = kv.shape[3]
            cache.buffer[:, :, row, :, width - length : width] = kv
            cache.lengths[row] = length
        cache.rows = len(pasts)
        cache.end = width
        return cache

    def attention_mask(self, new_tokens: int = 1) -> torch.Tensor:
        """``[rows, end + new_tokens]``: 1 where a row holds a token (its padding on the left is 0)."""
        columns = torch.arange(self.end + new_tokens)
        starts = self.end - self.lengths[: self.rows]
        return (columns[None, :] >= starts[:, None]).long()

    def positions(self) -> torch.Tensor:
        """``[rows, 1]``: the position of each row's next token, its own length (padding excluded)."""
        return self.lengths[: self.rows].unsqueeze(1).clone()

    def advance(self, new_tokens: int = 1) -> None:
        self.end += new_tokens
        self.lengths[: self.rows] += new_tokens

    def reserve(self, new_tokens: int = 1) -> None:
        """Make room for ``new_tokens`` more columns: drop unused leading columns, else grow."""
        if self.end + new_tokens <= self.capacity:
            return
        self._compact()
        if self.end + new_tokens > self.capacity:
            self._grow(self.end + new_tokens)

    def insert(self, kv: SequenceKV) -> int:
        """Add a prefilled sequence; returns its row."""
        if self.rows == self.max_rows:
            raise RuntimeError("batch cache is full")
        length = kv.shape[3]
        if self.capacity == 0:
            self.allocate(kv, max(INITIAL_CAPACITY, length + 1))
        if length > self.end:
            self._compact()
            self._shift_right(length - self.end)
        row = self.rows
        self.buffer[:, :, row, :, self.end - length : self.end] = kv
        self.lengths[row] = length
        self.rows += 1
        return row

    def row_kv(self, row: int, start: int, stop: int) -> SequenceKV:
        """A view of columns ``[start, stop)`` of one row (shared with the cache: clone to keep it)."""
        return self.buffer[:, :, row, :, start:stop]

    def extract(self, row: int) -> SequenceKV:
        """A copy of one row's KV without its padding, in the shape :meth:`insert` takes."""
        return self.row_kv(row, self.end - int(self.lengths[row]), self.end).clone()

    def remove(self, row: int) -> None:
        """Drop ``row``; the last row moves into its place (callers mirror this in their own lists)."""
        last = self.rows - 1
        if row != last:
            self.buffer[:, :, row, :, : self.end] = self.buffer[:, :, last, :, : self.end]
            self.lengths[row] = self.lengths[last]
        self.lengths[last] = 0
        self.rows = last
        if self.rows == 0:
            self.end = 0
        elif self._unused_columns() * 4 >= self.end:
            self._compact()

    def clear(self) -> None:
        self.rows = 0
        self.end = 0
        self.lengths.zero_()

    def allocate(self, like: torch.Tensor, capacity: int) -> None:
        """The buffer, ``capacity`` columns wide (at most ``max_length``); ``like``: any KV tensor
        of the model (``[..., kv_heads, length, head_dim]``), for the shape, dtype and device."""
        self.capacity = min(capacity, self.max_length)
        shape = (len(self.layers), 2, self.max_rows, like.shape[-3], self.capacity, like.shape[-1])
        if self.storage is not None:
            self._use(self.storage.take(shape, like))
            return
        # Zeros, not empty: padding columns are masked out, but garbage could be NaN and 0 * NaN is NaN.
        self._use(torch.zeros(shape, dtype=like.dtype, device=like.device))

    def _use(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        for index, layer in enumerate(self.layers):
            layer.keys, layer.values = buffer[index, 0], buffer[index, 1]
            layer.is_initialized = True

    def _unused_columns(self) -> int:
        return self.end - int(self.lengths[: self.rows].max()) if self.rows else self.end

    def _grow(self, needed: int) -> None:
        """A wider buffer, the rows copied over in one copy (old and new are held until it is done)."""
        if needed > self.max_length:
            raise RuntimeError(f"sequence of {needed} tokens exceeds the cache's {self.max_length}")
        capacity = min(max(needed, 2 * self.capacity), self.max_length)
        old = self.buffer
        new = torch.zeros((*old.shape[:4], capacity, old.shape[5]), dtype=old.dtype, device=old.device)
        new[:, :, : self.rows, :, : self.end] = old[:, :, : self.rows, :, : self.end]
        self._use(new)
        self.capacity = capacity

    def _compact(self) -> None:
        """Drop leading columns that no running row uses."""
        unused = self._unused_columns()
        if unused == 0:
            return
        kept = self.end - unused
        rows = self.buffer[:, :, : self.rows]
        rows[..., :kept, :] = rows[..., unused : self.end, :].clone()
        self.end = kept

    def _shift_right(self, columns: int) -> None:
        """Make ``columns`` more room on the left, so a longer sequence can end at the same column."""
        needed = self.end + columns
        if needed > self.capacity:
            self._grow(needed)
        if self.rows:
            rows = self.buffer[:, :, : self.rows]
            rows[..., columns:needed, :] = rows[..., : self.end, :].clone()
        self.end = needed
