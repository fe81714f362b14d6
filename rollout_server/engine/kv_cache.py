"""The KV cache of the running batch: one preallocated buffer per layer, sequences aligned at the end.

Layout per layer: ``keys`` and ``values`` of shape ``[max_rows, kv_heads, capacity, head_dim]``.
Rows ``0..rows-1`` are the running sequences; columns ``0..end-1`` hold data, and the sequence in
row ``r`` occupies the last ``lengths[r]`` of them (left padding, as ``generate()`` pads a batch).
So every row writes its next token into the same column ``end``: a decode step is one slice
write per layer, where ``DynamicCache`` would copy the whole cache with ``torch.cat``. Keeping
each sequence contiguous lets Hugging Face build its own masks as for any left-padded batch
(positions are passed explicitly): the model code is used unchanged, whatever the architecture.

Sequences join with their prefilled KV (right-aligned at ``end``; the batch shifts right when the
newcomer is longer than ``end``) and leave by moving the last row into their place. Leading
columns that no row uses any more are dropped when they waste a quarter of the width, and the
buffers grow by doubling up to the maximum model length, so memory is bounded by
``max_rows * max_model_len`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, kv_heads, length, head_dim]
INITIAL_CAPACITY = 256


class SlabLayer(CacheLayerMixin):
    """One model layer's view of the shared slab; the model calls :meth:`update` during forward."""

    is_sliding = False

    def __init__(self, slab: BatchKVCache) -> None:
        super().__init__()
        self.slab = slab

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("the batch cache is allocated when the first sequence joins")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def __init__(self, num_layers: int, max_rows: int, max_length: int) -> None:
        super().__init__(layers=[SlabLayer(self) for _ in range(num_layers)])
        self.max_rows = max_rows
        self.max_length = max_length
        self.rows = 0
        self.end = 0
        self.lengths = torch.zeros(max_rows, dtype=torch.long)
        self.capacity = 0

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

    def insert(self, kv: Sequence[LayerKV]) -> int:
        """Add a prefilled sequence (per layer ``[1, heads, length, head_dim]``); returns its row."""
        if self.rows == self.max_rows:
            raise RuntimeError("batch cache is full")
        length = kv[0][0].shape[-2]
        if self.capacity == 0:
            self._allocate(kv[0][0], max(INITIAL_CAPACITY, length + 1))
        if length > self.end:
            self._compact()
            self._shift_right(length - self.end)
        row = self.rows
        for layer, (keys, values) in zip(self.layers, kv, strict=True):
            layer.keys[row, :, self.end - length : self.end] = keys[0]
            layer.values[row, :, self.end - length : self.end] = values[0]
        self.lengths[row] = length
        self.rows += 1
        return row

    def extract(self, row: int) -> list[LayerKV]:
        """A copy of one row's KV without its padding, in the shape :meth:`insert` takes."""
        start = self.end - int(self.lengths[row])
        return [
            (
                layer.keys[row : row + 1, :, start : self.end].clone(),
                layer.values[row : row + 1, :, start : self.end].clone(),
            )
            for layer in self.layers
        ]

    def remove(self, row: int) -> None:
        """Drop ``row``; the last row moves into its place (callers mirror this in their own lists)."""
        last = self.rows - 1
        if row != last:
            for layer in self.layers:
                layer.keys[row, :, : self.end] = layer.keys[last, :, : self.end]
                layer.values[row, :, : self.end] = layer.values[last, :, : self.end]
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

    def _unused_columns(self) -> int:
        return self.end - int(self.lengths[: self.rows].max()) if self.rows else self.end

    def _allocate(self, like: torch.Tensor, capacity: int) -> None:
        self.capacity = min(capacity, self.max_length)
        shape = (self.max_rows, like.shape[1], self.capacity, like.shape[3])
        for layer in self.layers:
            # Zeros, not empty: padding columns are masked out, but garbage could be NaN and 0 * NaN is NaN.
            layer.keys = torch.zeros(shape, dtype=like.dtype, device=like.device)
            layer.values = torch.zeros(shape, dtype=like.dtype, device=like.device)
            layer.is_initialized = True

    def _grow(self, needed: int) -> None:
        if needed > self.max_length:
            raise RuntimeError(f"sequence of {needed} tokens exceeds the cache's {self.max_length}")
        capacity = min(max(needed, 2 * self.capacity), self.max_length)
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = torch.zeros(
                    (*old.shape[:2], capacity, old.shape[3]), dtype=old.dtype, device=old.device
                )
                new[: self.rows, :, : self.end] = old[: self.rows, :, : self.end]
                setattr(layer, name, new)
        self.capacity = capacity

    def _compact(self) -> None:
        """Drop leading columns that no running row uses."""
        unused = self._unused_columns()
        if unused == 0:
            return
        kept = self.end - unused
        for layer in self.layers:
            layer.keys[: self.rows, :, :kept] = layer.keys[: self.rows, :, unused : self.end].clone()
            layer.values[: self.rows, :, :kept] = layer.values[: self.rows, :, unused : self.end].clone()
        self.end = kept

    def _shift_right(self, columns: int) -> None:
        """Make ``columns`` more room on the left, so a longer sequence can end at the same column."""
        needed = self.end + columns
        if needed > self.capacity:
            self._grow(needed)
        if self.rows:
            for layer in self.layers:
                layer.keys[: self.rows, :, columns:needed] = layer.keys[: self.rows, :, : self.end].clone()
                layer.values[: self.rows, :, columns:needed] = layer.values[
                    : self.rows, :, : self.end
                ].clone()
        self.end = needed
