"""Making a dataset's items and scoring replies, safely on the host's concurrent worker threads.

**Datasets are shared.** Building one costs up to 0.7 s (arc_agi reads its JSON; group_anagrams
0.6 s, figlet_font 0.3 s, acre 0.2 s, word_ladder and codeio 0.15 s; most under 0.1 ms), so
each process builds a dataset once per (name, config), on the first reset that needs it, while
concurrent resets of the same pair wait for it (:class:`~env_server.shared.ProcessShared`).
An item then costs 0.12 ms for the median dataset (default configs, 10 seeds each, 2-core dev
machine), 0.1-0.2 s for futoshiki and zebra_puzzles, and 1.2 s for knight_swap (4.2 s at worst).

**Items are independent of other threads.** Two things in reasoning-gym 0.1.25 would make one
seed's item depend on what another thread did at the same time:

* Writes to the dataset object while making an item: word_ladder sets ``self.size`` to the index
  it failed at (so every later index fails too) and tsumego keeps its ko point in ``self``.
  Each item is made from a shallow copy, whose writes go nowhere (3-5 µs).
* The process-wide RNGs: list_functions draws from ``random`` (one of its generators calls
  ``random.randint``) and pool_matrix seeds and draws numpy's global RNG. Their items are made
  under one process-wide lock, with ``random`` seeded from the item's index and both RNGs'
  states put back afterwards, so other code in the process sees no change either.

**Items have a work budget.** A few items of some generators take unboundedly long: item
207,006,210 of basic_arithmetic ran for 62 s (a divisor search up to the square root of a huge
gcd), holding a worker thread and its episode. An item is made with a line tracer that counts the
Python lines it runs; past :data:`ITEM_LINE_BUDGET` it is abandoned and the next index is made
instead. Lines, not seconds, so the same seed gives the same item on any machine. Tracing costs
2.5-5x on item generation (basic_arithmetic 0.07 -> 0.2 ms, zebra_puzzles 0.12 -> 0.41 s).
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import numpy as np
from reasoning_gym.dataset import ProceduralDataset

from env_server.envs.reasoning.catalog import DatasetInfo
from env_server.envs.reasoning.config_options import DatasetConfig
from env_server.envs.reasoning.reply_guard import may_score
from env_server.shared import ProcessShared
from services.errors import ApiError

T = TypeVar("T")

USES_GLOBAL_RNG = frozenset({"list_functions", "pool_matrix"})
# 5 million lines are ~1 s traced here; the slowest item seen within it, knight_swap's item 0 (1.0 s
# untraced, 2.9 s traced: much of its time is in C), passes.
ITEM_LINE_BUDGET = 5_000_000
# Indexes tried after an item over budget, before the seed is refused: over-budget items are rare
# (1 of 2,070 consecutive basic_arithmetic resets), so 16 in a row means the config cannot make one.
MAX_SKIPPED_ITEMS = 16
# Configs kept per dataset, least recently used dropped first, so a stream of distinct configs
# cannot exhaust memory: a process holding all 100 default datasets has 212 MB of RSS (arc_agi
# 28 MB of it, the most), and a curriculum's few difficulty levels of one dataset stay built.
MAX_CONFIGS_PER_DATASET = 8

_global_rng_lock = threading.Lock()
_datasets: dict[str, dict[str, ProcessShared[ProceduralDataset]]] = {}
_datasets_lock = threading.Lock()


def shared_dataset(info: DatasetInfo, config: DatasetConfig) -> ProceduralDataset:
    """The process's dataset for ``info`` and ``config``, built by the first caller.

    A config that passes ``validate()`` but that the dataset's constructor refuses (rush_hour with
    no puzzle in its range of moves) is an :class:`ApiError` 422 naming reasoning-gym's reason.
    """
    key = config.model_dump_json()
    with _datasets_lock:
        built = _datasets.setdefault(info.name, {})
        shared = built.pop(key, None)
        if shared is None:
            shared = ProcessShared("reasoning", lambda: _build(info, config), ())
        built[key] = shared  # (re)inserted last: the dict's order is the order of use
        if len(built) > MAX_CONFIGS_PER_DATASET:
            del built[next(iter(built))]
    return shared.get()


def _build(info: DatasetInfo, config: DatasetConfig) -> ProceduralDataset:
    try:
        return info.dataset_class(config=config.dataclass_config())
    except Exception as exc:
        raise ApiError(
            422, "invalid_options", f"reasoning/{info.name}: reasoning-gym cannot build this config: {exc}"
        ) from None


def make_item(info: DatasetInfo, dataset: ProceduralDataset, index: int) -> tuple[int, dict[str, Any]]:
    """Item ``index`` of ``dataset`` (or, past the work budget, the next index's): the index
    used and the item, the same whatever other threads do.

    An item reasoning-gym cannot make (a config so tight that its generator gives up), or one
    more than :data:`MAX_SKIPPED_ITEMS` indexes in a row over budget, is an :class:`ApiError` 422:
    these options do not make a question for this seed.
    """
    for used in range(index, index + MAX_SKIPPED_ITEMS + 1):
        used %= info.item_count
        try:
            with _own_global_rngs(info.name, used):
                return used, _within_line_budget(lambda: copy.copy(dataset)[used])  # noqa: B023
        except OverBudget:
            continue
        except Exception as exc:
            raise ApiError(
                422,
                "invalid_options",
                f"reasoning/{info.name}: reasoning-gym cannot make item {used} with these options: {exc}",
            ) from None
    raise ApiError(
        422,
        "invalid_options",
        f"reasoning/{info.name}: items {index}-{used} each ran over {ITEM_LINE_BUDGET:,} lines of Python "
        "with these options",
    )


class OverBudget(Exception):
    """An item's generator ran more than :data:`ITEM_LINE_BUDGET` lines."""


def _within_line_budget(make: Callable[[], T]) -> T:
    """``make()``, abandoned with :class:`OverBudget` once it has run ITEM_LINE_BUDGET lines
    (counted in this thread; the tracer of a debugger, if any, is put back afterwards)."""
    lines = 0

    def count_line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if lines > ITEM_LINE_BUDGET:
                raise OverBudget
        return count_line

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: count_line)
    try:
        return make()
    finally:
        sys.settrace(previous)


def score(info: DatasetInfo, dataset: ProceduralDataset, answer: str, entry: dict[str, Any]) -> float:
    """The dataset's own ``score_answer`` of ``answer``; 0 when the scorer fails on it (some
    raise on what they cannot parse: prime_factorization's ``int()`` on a word) or when
    :func:`~.reply_guard.may_score` keeps it away from a scorer that would run it."""
    if not may_score(info.name, answer, entry):
        return 0.0
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:
        return 0.0


@contextlib.contextmanager
def _own_global_rngs(dataset: str, seed: int) -> Iterator[None]:
    """For a dataset in :data:`USES_GLOBAL_RNG`: the process's RNGs to itself, ``random`` seeded."""
    if dataset not in USES_GLOBAL_RNG:
        yield
        return
    with _global_rng_lock:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
