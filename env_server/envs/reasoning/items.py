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
"""

from __future__ import annotations

import contextlib
import copy
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from reasoning_gym.dataset import ProceduralDataset

from env_server.envs.reasoning.catalog import DatasetInfo
from env_server.envs.reasoning.config_options import DatasetConfig
from env_server.envs.reasoning.reply_guard import may_score
from env_server.shared import ProcessShared
from services.errors import ApiError

USES_GLOBAL_RNG = frozenset({"list_functions", "pool_matrix"})
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


def make_item(info: DatasetInfo, dataset: ProceduralDataset, index: int) -> dict[str, Any]:
    """Item ``index`` of ``dataset``: the same for the same index whatever other threads do.

    An item reasoning-gym cannot make (a config so tight that its generator gives up) is an
    :class:`ApiError` 422: these options do not make a question for this seed.
    """
    try:
        with _own_global_rngs(info.name, index):
            return copy.copy(dataset)[index]
    except Exception as exc:
        raise ApiError(
            422,
            "invalid_options",
            f"reasoning/{info.name}: reasoning-gym cannot make item {index} with these options: {exc}",
        ) from None


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
