"""ScienceWorld: elementary-school science tasks in a simulated house (the ``scienceworld`` package).

The package's 30 tasks (boil water, find a living thing, build a circuit, ...) each come in many
variations (other substances, rooms, objects), which the package splits into train, dev and test
sets. The simulator runs in a JVM; instances lease JVMs from the bounded pool of
:mod:`env_server.envs.embodied.jvm_pool` and run every JVM call on the host's worker threads.

Per step we call the simulator directly instead of the package's ``ScienceWorldEnv.step``, which
makes five more JVM calls (look, inventory, task description, valid actions, moves) on every
step whether or not anyone reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from scienceworld.constants import TASKS as PACKAGE_TASKS
from scienceworld.utils import infer_task

from env_server.core import Env, Observation, Step
from env_server.envs.embodied.jvm_pool import (
    JvmPool,
    Lease,
    ScienceWorldJvm,
    shared_pool,
    shutdown_shared_pool,
)
from services.errors import ApiError

Split = Literal["train", "dev", "test", "all"]
Simplification = Literal[
    "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors", "noElectricalAction", "easy"
]

# Variations per task and where its dev and test splits start (train is [0, dev), dev is
# [dev, test), test is [test, variations)): what scienceworld 1.2.3's simulator answers, asked
# once (tests/unit/test_jvm_pool.py checks it still does). Kept here so that options are checked,
# and a 422 answered, before any JVM is involved.
VARIATIONS: dict[str, tuple[int, int, int]] = {
    "1-1": (30, 14, 21),
    "1-2": (30, 14, 21),
    "1-3": (30, 14, 21),
    "1-4": (30, 14, 21),
    "2-1": (540, 270, 405),
    "2-2": (436, 218, 327),
    "2-3": (300, 150, 225),
    "3-1": (20, 10, 15),
    "3-2": (20, 10, 15),
    "3-3": (900, 450, 675),
    "3-4": (600, 300, 450),
    "4-1": (300, 150, 225),
    "4-2": (300, 150, 225),
    "4-3": (300, 150, 225),
    "4-4": (300, 150, 225),
    "5-1": (126, 62, 93),
    "5-2": (126, 62, 93),
    "6-1": (32, 16, 24),
    "6-2": (36, 18, 27),
    "6-3": (36, 18, 27),
    "7-1": (125, 62, 93),
    "7-2": (125, 62, 93),
    "7-3": (125, 62, 93),
    "8-1": (14, 6, 9),
    "8-2": (10, 4, 6),
    "9-1": (168, 84, 126),
    "9-2": (1386, 692, 1038),
    "9-3": (162, 80, 120),
    "10-1": (120, 60, 90),
    "10-2": (480, 240, 360),
}
# The tasks AgentGym's ScienceWorld server leaves out of its data_idx list.
AGENTGYM_EXCLUDED = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
NO_MATCH = "No known action matches that input."
# available_actions lists at most this many. The simulator's valid actions number 417-941 in the
# states measured, of which 306-600 are "connect X to Y" over every pair of objects in view; the
# actions with no or one object (open, go to, pick up, focus on, look at, ...: 95-125 measured)
# come first, then two-object ones with "connect" last, so the cap drops only pairings.
MAX_AVAILABLE_ACTIONS = 200


@dataclass(frozen=True)
class Task:
    id: str  # the paper's numbering, "1-1"
    name: str  # the simulator's, "boil"
    variations: int
    dev_start: int
    test_start: int

    def split(self, split: Split) -> range:
        bounds = {
            "train": (0, self.dev_start),
            "dev": (self.dev_start, self.test_start),
            "test": (self.test_start, self.variations),
            "all": (0, self.variations),
        }
        return range(*bounds[split])

    def split_of(self, variation: int) -> Split:
        return "train" if variation < self.dev_start else "dev" if variation < self.test_start else "test"

    @property
    def electrical(self) -> bool:
        """The package refuses noElectricalAction for these: they need the connect actions."""
        return "power-component" in self.name or "conductivity" in self.name


TASKS = tuple(
    Task(t["task_id"], infer_task(t["task_name"]), *VARIATIONS[t["task_id"]]) for t in PACKAGE_TASKS
)
TASKS_BY_NAME = {task.name: task for task in TASKS}
TASKS_BY_ID = {task.id: task for task in TASKS}
AGENTGYM_TASKS = tuple(task for task in TASKS if task.id not in AGENTGYM_EXCLUDED)
AGENTGYM_SIZE = sum(task.variations for task in AGENTGYM_TASKS)  # 4639


class SciWorldOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str | int | None = Field(
        default=None,
        description="A task by name ('boil'), id ('1-1') or index (0-29); none: the seed picks one "
        "of the 30 (seed % 30).",
    )
    split: Split = Field(default="train", description="The variations to draw from ('all': every one).")
    variation: int | None = Field(
        default=None,
        ge=0,
        description="One variation of the task, within the split; none: the seed picks one.",
    )
    simplifications: list[Simplification] = Field(
        default_factory=list, description="The package's simplifications ('easy': all of them)."
    )
    gold_path: bool = Field(
        default=False,
        description="Put a winning action sequence in the reset's info['gold_actions'] (adds 0.1-14 s "
        "to the reset, most for the genetics tasks).",
    )
    action_hints: bool = Field(
        default=True,
        description="Work out the valid actions after every step for available_actions: a step "
        "then takes 59 ms instead of 4 ms (medians measured). False: available_actions is None.",
    )

    @field_validator("task")
    @classmethod
    def known_task(cls, value: str | int | None) -> str | None:
        if value is None:
            return None
        if isinstance(value, int) or value.isdigit():
            index = int(value)
            if not 0 <= index < len(TASKS):
                raise ValueError(f"task index {index} is not in 0-{len(TASKS) - 1}")
            return TASKS[index].name
        task = TASKS_BY_ID.get(value) or TASKS_BY_NAME.get(infer_task(value))
        if task is None:
            raise ValueError(f"unknown task {value!r}; tasks: {', '.join(TASKS_BY_NAME)}")
        return task.name

    @model_validator(mode="after")
    def consistent(self) -> SciWorldOptions:
        task = TASKS_BY_NAME[self.task] if isinstance(self.task, str) else None
        if self.variation is not None:
            if task is None:
                raise ValueError("a variation needs a task")
            if self.variation not in task.split(self.split):
                raise ValueError(
                    f"variation {self.variation} is not in {task.name}'s {self.split} split "
                    f"({_span(task.split(self.split))}); pick another split or 'all'"
                )
        if "noElectricalAction" in self.simplifications and (task is None or task.electrical):
            raise ValueError("noElectricalAction needs a task that is not about electricity")
        return self


class SciWorldEnv(Env):
    """One ScienceWorld episode on a JVM leased from the pool.

    Options pick the task (or the seed does, ``seed % 30``) and the split; the seed picks the
    variation within the split unless one is given. The first observation is the task's
    description and a look around, as AgentGym's server gives it. Actions are the simulator's
    free text; one it cannot parse is an observation saying so with ``info["valid"] = False``.

    The reward of a step is the change of the simulator's score (0-100) over 100, so an
    episode's rewards add up to its final score / 100: 1.0 when solved, -1.0 when failed (the
    simulator sets the score to -100, e.g. after focusing on the wrong object). The episode ends
    at 100 or on failure.
    """

    name = "sciworld"
    family = "embodied"
    instruction = (
        "You are an agent in ScienceWorld, a text simulation of a house and its surroundings, "
        "where you carry out elementary-school science tasks. Every turn you see an observation "
        "and reply with one action. Actions: look around; look at OBJ; look in OBJ; read OBJ; "
        "open OBJ; close OBJ; activate OBJ; deactivate OBJ; pick up OBJ; put down OBJ; move OBJ "
        "to OBJ; pour OBJ in OBJ; dunk OBJ in OBJ; mix OBJ; use OBJ on OBJ; connect OBJ to OBJ; "
        "disconnect OBJ; eat OBJ; flush OBJ; go to LOC; focus on OBJ; wait (10 time steps); "
        "wait1 (1 time step); inventory; task (repeats the task). Focus on an object only when "
        "the task asks you to: focusing on the wrong one fails the task. When an action is "
        "ambiguous you are shown numbered choices; reply with the number."
    )
    action_format = "one action, e.g. 'open door to kitchen', 'go to kitchen', 'move ice to metal pot'"
    default_max_turns = 30  # AgentGym-RL's longest SciWorld horizon (10/20/30)
    # Per step: +1.0 at most (0 to 100), -1.99 at worst (from 99 to the failure's -100).
    reward_range = (-2.0, 1.0)
    Options = SciWorldOptions
    trusted = True  # ours, fuzzed (tests/integration/test_fuzz_steps.py); the JVM pool kills hung calls

    def __init__(self, pool: JvmPool | None = None) -> None:
        """``pool``: the JVM pool to lease from; by default the process's shared one."""
        self._pool = pool
        self._lease: Lease | None = None
        self._score = 0
        self._action_hints = True
        self._available: list[str] | None = None

    @classmethod
    def agentgym_task(cls, data_idx: int) -> tuple[int, dict[str, Any] | None]:
        """AgentGym's data_idx: every variation of its 23 tasks (all but 5-x, 9-x and 10-x),
        task after task in the package's order: 0-29 are boil's, 30-59 melt's, ..., 4638 the last."""
        index = data_idx
        for task in AGENTGYM_TASKS:
            if index < task.variations:
                return data_idx, {"task": task.name, "split": "all", "variation": index}
            index -= task.variations
        raise ApiError(
            422,
            "invalid_options",
            f"data_idx {data_idx} is past the {AGENTGYM_SIZE} ScienceWorld tasks of AgentGym's list",
        )

    @classmethod
    def shutdown(cls) -> None:
        """End the shared JVM pool: the host's hook once it has closed every instance (an idle
        JVM would otherwise outlive it by the ~0.3 s it takes to notice its stdin closed)."""
        shutdown_shared_pool()

    async def start(self) -> None:
        if self._lease is None:
            self._lease = await self._jvm_pool().acquire_async()

    def reset(self, seed: int, options: SciWorldOptions) -> Observation:
        if self._lease is None:  # used directly, not through a host that awaited start()
            self._lease = self._jvm_pool().acquire()
        task, variation = choose(seed, options)

        def begin(jvm: ScienceWorldJvm) -> tuple[str, str, list[str] | None, list[str] | None]:
            simplifications = ",".join(options.simplifications)
            jvm.load(task.name, variation, simplifications, generateGoldPath=options.gold_path)
            look = jvm.server.step("look around")
            gold = jvm.get_gold_action_sequence() if options.gold_path else None
            available = valid_actions(jvm) if options.action_hints else None
            return jvm.server.getTaskDescription(), look, gold, available

        description, look, gold, self._available = self._lease.run(begin, fresh=True)
        # From 0, not from the score after the first look around: an episode that starts in the
        # task's room has 8 points already, which its first step's reward then includes, so the
        # rewards add up to the final score.
        self._score = 0
        self._action_hints = options.action_hints
        info: dict[str, Any] = {
            "task": task.name,
            "task_id": task.id,
            "variation": variation,
            "split": task.split_of(variation),
        }
        if gold is not None:
            info["gold_actions"] = gold
        return Observation(f"{description}\n{look}", info)

    def step(self, action: str) -> Step:
        if self._lease is None:
            raise RuntimeError("reset the env before stepping it")
        command = normalise(action)

        def act(jvm: ScienceWorldJvm) -> tuple[str, int, bool, list[str] | None]:
            observation = jvm.server.step(command)
            score = round(100 * jvm.server.getScore())
            # The simulator marks a solved task completed but leaves a failed one (score -100)
            # open; the package's own step() ends both, as we do.
            done = score >= 100 or score < 0 or jvm.server.getCompleted()
            available = valid_actions(jvm) if self._action_hints and not done else None
            return observation, score, done, available

        observation, score, done, available = self._lease.run(act)
        reward = (score - self._score) / 100
        self._score = score
        self._available = [] if done and self._action_hints else available
        info = {"valid": not observation.startswith(NO_MATCH), "score": score, "success": score >= 100}
        return Step(observation, reward, done, info)

    def available_actions(self) -> list[str] | None:
        """The simulator's valid actions now (capped, see ``MAX_AVAILABLE_ACTIONS``), worked out
        with the last reset or step so that this costs no JVM call; None without action hints."""
        return self._available

    def close(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _jvm_pool(self) -> JvmPool:
        if self._pool is None:
            self._pool = shared_pool()
        return self._pool


def choose(seed: int, options: SciWorldOptions) -> tuple[Task, int]:
    """The task and variation that ``seed`` and ``options`` mean."""
    if options.task is None:
        task, pick = TASKS[seed % len(TASKS)], seed // len(TASKS)
    else:
        task, pick = TASKS_BY_NAME[str(options.task)], seed
    if options.variation is not None:
        return task, options.variation
    variations = task.split(options.split)
    return task, variations[pick % len(variations)]


def valid_actions(jvm: ScienceWorldJvm) -> list[str]:
    """The simulator's valid actions, fewest objects first, "connect" pairings last, capped.

    One JSON string over py4j: the package's list-returning call fetches element by element.
    """
    combos = json.loads(jvm.server.getValidActionObjectCombinationsJSON())["validActions"]
    ranked = sorted(
        combos, key=lambda c: (len(c["obj_ids"]), c["action"].startswith("connect "), c["action"])
    )
    return list(dict.fromkeys(c["action"] for c in ranked))[:MAX_AVAILABLE_ACTIONS]


def normalise(action: str) -> str:
    """Single spaces and no final full stop: the simulator refuses 'look around.'."""
    return " ".join(action.split()).rstrip(".").rstrip()


def _span(variations: range) -> str:
    return f"{variations.start}-{variations.stop - 1}" if variations else "none"
