"""Which reasoning-gym datasets the family hosts, how many items each has, and how each is described.

Every dataset in reasoning-gym's registry (``reasoning_gym.factory.DATASETS``, 106 in 0.1.25) is
hosted except these six (all 106 build and score offline):

=========================  ===================================================================
dataset                    why it is not hosted
=========================  ===================================================================
composite                  mixes other datasets and needs a config that names them; host
                           those datasets instead
game_of_life_halting       its ``score_answer`` gives 1 to every non-empty reply (it compares
                           ``bool()`` of two non-empty strings): there is nothing to learn
intermediate_integration   its scorer takes ``Integral(f, x)``, the question's integrand
                           wrapped, as a correct antiderivative, and 25 of its first 200 gold
                           answers are such unevaluated integrals: with ``Integral`` refused
                           (:mod:`.reply_guard`) those items cannot be solved, with it allowed
                           RL learns the wrapper
isomorphic_strings,        the same seed asks another question in another process: they draw
ransom_note                with ``rng.choice(list(a set of letters))``, whose order follows the
                           process's string hashing (``PYTHONHASHSEED``): 16 of 16 seeds
                           differed between two processes, so env replicas would disagree and
                           a GRPO group spread over them would not share its question
polynomial_multiplication  the same (10 of 16 seeds differed): it draws from a list of sympy
                           monomials made from a set
=========================  ===================================================================

An env's seed picks item ``seed % item_count`` of a dataset built with reasoning-gym seed 0, so
the question for seed ``s`` is ``reasoning_gym.create_dataset(name, seed=0, size=item_count,
**config)[s % item_count]``: most datasets derive item ``i`` from ``Random(seed + i)`` alone and
get 2**31 items (the host draws seeds below 2**31; numpy's legacy seeding, which pool_matrix
uses, refuses seeds of 2**32 and more). A few build per-item state in their constructor, so
their size costs time there and they keep a smaller one (:data:`ITEM_COUNTS`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS

EXCLUDED: dict[str, str] = {
    "composite": "mixes other datasets and needs a config naming them",
    "game_of_life_halting": "its score_answer gives 1 to every non-empty reply",
    "intermediate_integration": "its scorer accepts Integral(integrand, x); 12 % of its gold answers are one",
    "isomorphic_strings": "its questions depend on the process's string hashing",
    "polynomial_multiplication": "its questions depend on the process's string hashing",
    "ransom_note": "its questions depend on the process's string hashing",
}

DEFAULT_ITEM_COUNT = 2**31
ITEM_COUNTS: dict[str, int] = {
    # Generates all its questions in the constructor: 200 ms for reasoning-gym's default 500.
    "acre": 500,
    # Draw a task per item in the constructor: 8 ms for 2**16 items, 130 ms for 2**20.
    "gsm_symbolic": 2**16,
    "list_functions": 2**16,
    # Its validate() refuses a size above 20,000.
    "word_ladder": 20_000,
}

# reasoning-gym 0.1.25 gives these datasets no docstring, one about the code rather than the task
# (codeio), or another dataset's (number_format says "Count Bits", string_manipulation "String Insertion").
DESCRIPTIONS: dict[str, str] = {
    "acre": "Causal induction (ACRE): from Blicket-detector experiments, say whether a new set of "
    "objects turns the detector on, off, or is undetermined.",
    "arc_agi": "ARC-AGI puzzles: infer the rule that maps the example input grids to output grids "
    "and apply it to the test grid.",
    "boxnet": "BoxNet planning: direct agents on a grid to move coloured boxes to their targets; the "
    "reply is a JSON action plan.",
    "calendar_arithmetic": "Calendar arithmetic: weekdays, date offsets, leap years and day counts.",
    "codeio": "CodeI/O: reason about curated Python programs, predicting an output from an input or "
    "an input that gives an output.",
    "emoji_mystery": "Decode a sentence hidden in an emoji's Unicode variation selectors.",
    "gsm_symbolic": "GSM-Symbolic: grade-school maths word problems from templates with fresh numbers.",
    "list_functions": "List functions: infer the rule that maps example input lists to output lists "
    "and apply it to a new list.",
    "number_format": "Pick the largest or smallest of several numbers written in different formats.",
    "puzzle24": "The 24 game: combine four numbers with + - * / to make 24.",
    "rearc": "RE-ARC: generated ARC grid puzzles; infer the rule from the examples and apply it.",
    "string_manipulation": "Apply ordered rewrite rules to a string until none applies or a state "
    "repeats, and give the final string.",
    "survo": "Survo puzzles: fill a matrix's zeros from given numbers so that every row and column "
    "adds up to its total.",
}


@dataclass(frozen=True)
class DatasetInfo:
    """One hosted dataset: reasoning-gym's classes for it and what the env says about it."""

    name: str
    dataset_class: type[ProceduralDataset]
    config_class: type[Any]
    item_count: int
    description: str


def hosted_datasets() -> list[DatasetInfo]:
    """Every registered dataset but :data:`EXCLUDED`, in name order."""
    return [
        DatasetInfo(
            name=name,
            dataset_class=dataset_class,
            config_class=config_class,
            item_count=ITEM_COUNTS.get(name, DEFAULT_ITEM_COUNT),
            description=describe(name, dataset_class, config_class),
        )
        for name, (dataset_class, config_class) in sorted(DATASETS.items())
        if name not in EXCLUDED
    ]


def describe(name: str, dataset_class: type, config_class: type) -> str:
    """``reasoning-gym's NAME dataset (CATEGORY): WHAT IT IS``, from :data:`DESCRIPTIONS` or the
    first paragraph of the dataset's docstring, else of its config's (a dataclass's own repr-like
    docstring, ``Config(a: int = 1, ...)``, says nothing and is skipped)."""
    text = DESCRIPTIONS.get(name) or _first_paragraph(dataset_class) or _first_paragraph(config_class)
    category = dataset_class.__module__.split(".")[1]
    return f"reasoning-gym's {name} dataset ({category}): {text or name.replace('_', ' ')}"


def _first_paragraph(cls: type) -> str:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())
