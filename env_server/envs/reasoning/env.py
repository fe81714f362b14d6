"""The env of one reasoning-gym dataset: a question per seed, answered in one or more attempts.

**Episode.** The first observation is the question of the dataset's item for the seed (see
:mod:`.catalog` for which). Every reply is an attempt, graded by the dataset's own
``score_answer`` (a score in [0, 1]; many give partial credit). The episode ends at the first
correct attempt or after ``max_attempts`` of them (default 1); a wrong attempt before the last
is told its score and to try again.

**Reward.** Only the attempt that ends the episode earns its score: the return is 1 when an
attempt is correct, else the last attempt's score, so a policy gains nothing by guessing through
its attempts for partial credit, and the return stays in the declared range [0, 1].

**Success** is a score of exactly 1: below that reasoning-gym's scorers grant partial credit to
flawed answers (the default scorer gives len(answer)/len(reply) to a reply that merely contains
the answer; boxnet the fraction of boxes moved, countdown 0.05 for using the numbers wrongly),
and a gold answer scores exactly 1 in every hosted dataset.

**Info.** ``valid`` is False for an empty answer (still an attempt, scoring 0); ``score``,
``success`` and ``attempts_left`` come with every step, and reasoning-gym's answer only once the
episode is over (``answer``), so it cannot leak into an attempt. It is None where many answers
are right and the scorer checks a reply's validity (rush_hour, boxnet, graph_color,
propositional_logic, rubiks_cube); for knight_swap and word_ladder it is one of several right
answers, and which one follows the process's string hashing.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.utils import extract_answer

from env_server.core import Env, Observation, Step
from env_server.envs.reasoning.catalog import DatasetInfo
from env_server.envs.reasoning.config_options import DatasetConfig, config_model
from env_server.envs.reasoning.items import make_item, score, shared_dataset

MAX_ATTEMPTS = 10
SOLVED = 1.0
ACTION_FORMAT = (
    "the answer, in the form the question asks for. When the reply has <answer>...</answer> blocks, "
    "only the last one's text is graded (reasoning-gym's extract_answer), so a reply may reason first"
)


class ReasoningOptions(BaseModel):
    """What every reasoning env accepts; each env's subclass adds its dataset's ``config``."""

    model_config = ConfigDict(extra="forbid")

    config: DatasetConfig  # each env's subclass: its dataset's config model, defaulting to its defaults
    max_attempts: int = Field(
        default=1,
        ge=1,
        le=MAX_ATTEMPTS,
        description="Replies the agent may give; after a wrong one it is told its score and to try again.",
    )


class ReasoningEnv(Env):
    """Base of the generated env classes; ``dataset`` says which reasoning-gym dataset it serves."""

    family = "reasoning"
    action_format = ACTION_FORMAT
    default_max_turns = 1  # the default max_attempts; a job with more attempts asks for more turns
    reward_range = (0.0, 1.0)
    # Not inline: a reset costs 0.12 ms and a step 0.012 ms for the median dataset, but resets of
    # knight_swap take 1.2 s and steps of rubiks_cube 5 ms, and any dataset's cost grows with its
    # config, which runs_inline, a class attribute, cannot follow.
    runs_inline = False
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py
    dataset: ClassVar[DatasetInfo]

    def __init__(self) -> None:
        self._items: ProceduralDataset | None = None
        self._entry: dict[str, Any] = {}
        self._attempts_left = 0

    def reset(self, seed: int, options: ReasoningOptions) -> Observation:
        info = self.dataset
        self._items = shared_dataset(info, options.config)
        index, self._entry = make_item(info, self._items, seed % info.item_count)
        self._attempts_left = options.max_attempts
        return Observation(
            self._entry["question"],
            {"dataset": info.name, "index": index, "attempts_left": self._attempts_left},
        )

    def step(self, action: str) -> Step:
        assert self._items is not None, "reset first"
        extracted = extract_answer(action)
        answer = (action if extracted is None else extracted).strip()
        graded = score(self.dataset, self._items, answer, self._entry) if answer else 0.0
        self._attempts_left -= 1
        solved = graded >= SOLVED
        done = solved or self._attempts_left == 0
        info: dict[str, Any] = {
            "valid": bool(answer),
            "success": solved,
            "score": graded,
            "attempts_left": self._attempts_left,
        }
        if done:
            gold = self._entry["answer"]
            info["answer"] = gold if gold is None or isinstance(gold, str) else str(gold)
        return Step(self._feedback(answer, graded, solved), graded if done else 0.0, done, info)

    def _feedback(self, answer: str, graded: float, solved: bool) -> str:
        if solved:
            return "Correct."
        verdict = "Empty answer (score 0)." if not answer else f"Wrong (score {graded:g})."
        if self._attempts_left == 0:
            return verdict
        plural = "s" if self._attempts_left > 1 else ""
        return f"{verdict} Try again: {self._attempts_left} attempt{plural} left."


def env_class(info: DatasetInfo, module: str) -> type[ReasoningEnv]:
    """The env class of ``info``'s dataset, e.g. ``MazeEnv`` for ``reasoning/maze``, as an
    attribute of ``module`` would be (entry points name it there)."""
    class_name = "".join(part.capitalize() for part in info.name.split("_")) + "Env"
    config = config_model(info)
    options = create_model(
        class_name.removesuffix("Env") + "Options",
        __base__=ReasoningOptions,
        __module__=module,
        config=(
            config,
            Field(default_factory=config, description=f"reasoning-gym's config of {info.name}."),
        ),
    )
    attributes = {
        "__module__": module,
        "__qualname__": class_name,
        "__doc__": info.description,
        "name": info.name,
        "dataset": info,
        "instruction": f"{info.description}\nAnswer the question; reasoning-gym's scorer for "
        f"{info.name} grades the reply.",
        "Options": options,
    }
    return type(class_name, (ReasoningEnv,), attributes)
