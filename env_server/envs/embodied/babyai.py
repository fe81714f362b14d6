"""BabyAI (minigrid's grid-world levels) as a text env, in the style of AgentGym's BabyAI server.

Every ``BabyAI-*`` gymnasium id is a level; AgentGym's 40-level list is also selectable by
number, and AgentGym's ``/reset {"data_idx"}`` means level ``data_idx % 40 + 1`` with seed
``data_idx // 40`` (AgentGym-RL's mapping). minigrid generates the level from the seed, so the
same seed and level give the same episode, with all randomness in minigrid's own seeded RNG.

The agent reads a description of its 7x7 egocentric view (:mod:`babyai_text`) and acts with
AgentGym's high-level actions, each compiled into minigrid's primitive moves by path planning
over the cells seen so far (:mod:`babyai_planner`). Every observation ends with the actions
available now, as AgentGym's server appends them. The reward is minigrid's: on success
``1 - 0.9 * steps / step limit`` counted in primitive moves, 0 otherwise. The episode ends on
success, on a failed mission (e.g. a wrong object put down in PutNext) or when minigrid's step
limit runs out. An action that is not in the list moves nothing and costs no minigrid step: it
is an observation saying why, with ``info["valid"] = False``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import gymnasium
import minigrid  # noqa: F401 - importing it registers the BabyAI-* ids with gymnasium
from minigrid.envs.babyai.core import roomgrid_level
from minigrid.minigrid_env import MiniGridEnv
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from env_server.core import Env, Observation, Step
from env_server.envs.embodied.babyai_planner import CHECK, ActionTable, Scene, compile_actions
from env_server.envs.embodied.babyai_text import describe, look

# Level generation prints every rejected sample ("Sampling rejected: unreachable object", 0-10
# lines a reset measured on GoToRedBall and PickupLoc) to stdout, which would flood a server's
# log; a module-level name shadows the builtin for that module only.
roomgrid_level.print = lambda *args, **kwargs: None

BABYAI_LEVELS = frozenset(level for level in gymnasium.registry if level.startswith("BabyAI-"))

# AgentGym's agentenv-babyai ``all_levels``, level 1 first. BabyAI-GoToObjS6-v0 is gone from
# minigrid 3.2.0; its successor -v1 (the same level, re-registered) stands in for it.
AGENTGYM_LEVELS = (
    "BabyAI-GoToRedBallGrey-v0",
    "BabyAI-GoToRedBall-v0",
    "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v1",
    "BabyAI-GoToLocalS8N7-v0",
    "BabyAI-GoToObjMazeS7-v0",
    "BabyAI-GoToImpUnlock-v0",
    "BabyAI-GoToSeqS5R2-v0",
    "BabyAI-GoToRedBlueBall-v0",
    "BabyAI-GoToDoor-v0",
    "BabyAI-GoToObjDoor-v0",
    "BabyAI-Open-v0",
    "BabyAI-OpenRedDoor-v0",
    "BabyAI-OpenDoorLoc-v0",
    "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0",
    "BabyAI-Pickup-v0",
    "BabyAI-UnblockPickup-v0",
    "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0",
    "BabyAI-PickupAbove-v0",
    "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0",
    "BabyAI-Unlock-v0",
    "BabyAI-UnlockLocalDist-v0",
    "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0",
    "BabyAI-BlockedUnlockPickup-v0",
    "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0",
    "BabyAI-FindObjS7-v0",
    "BabyAI-KeyCorridorS6R3-v0",
    "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0",
    "BabyAI-SynthS5R2-v0",
    "BabyAI-SynthLoc-v0",
    "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0",
    "BabyAI-BossLevel-v0",
    "BabyAI-BossLevelNoUnlock-v0",
)

UNRECOGNISED = "The action is not recognized. Please check valid actions."
# An action of a known form naming an object that is not in view now.
NAMES_AN_OBJECT = re.compile(r"(?:go to|pick up|go through|toggle and go through) (.+ \d+)")
COMPLETED = "The task is completed."
FAILED = "The task has failed."
OUT_OF_STEPS = "You have used up the step limit of this task."


# The ``level`` that trains on AgentGym's whole list: the seed picks the level and its layout,
# exactly as AgentGym's ``data_idx`` does (level ``seed % 40 + 1``, layout seed ``seed // 40``),
# so one entry of a training mix spans the 40 levels (the GPU recipe's setting).
AGENTGYM_MIX = "agentgym"


class BabyAIOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # GoToRedBall by default: AgentGym's level 2, one 8x8 room where a single "go to red ball 1"
    # wins once the ball is in view, so a tiny policy can learn it on a CPU; with seven
    # distractors it still needs reading the view, unlike GoToRedBallNoDists.
    level: StrictInt | str = Field(
        default="BabyAI-GoToRedBall-v0",
        description="A BabyAI-* gymnasium id, AgentGym's level number 1-40, or 'agentgym': the seed "
        "picks one of AgentGym's 40 levels (seed % 40 + 1) and its layout (seed // 40).",
    )

    @field_validator("level")
    @classmethod
    def known_level(cls, level: int | str) -> str:
        if isinstance(level, int):
            if not 1 <= level <= len(AGENTGYM_LEVELS):
                raise ValueError(
                    f"AgentGym's BabyAI levels are numbered 1-{len(AGENTGYM_LEVELS)}, not {level}"
                )
            return AGENTGYM_LEVELS[level - 1]
        if level != AGENTGYM_MIX and level not in BABYAI_LEVELS:
            raise ValueError(f"unknown level {level!r}: use a BabyAI-* id such as BabyAI-GoToRedBall-v0")
        return level


def normalise(action: str) -> str:
    """Lower case, single spaces, no surrounding quotes or full stop; AgentGym's ``pickup`` spelling too."""
    words = action.lower().replace("pickup", "pick up").split()
    return " ".join(words).strip(" .'\"")


def action_list(table: ActionTable) -> str:
    """AgentGym's suffix: ``Available actions: ["turn left", "turn right", ...]``."""
    return "Available actions: [" + ", ".join(json.dumps(action) for action in table.moves) + "]"


class BabyAIEnv(Env):
    name = "babyai"
    family = "embodied"
    instruction = (
        "You are an explorer in a grid world of rooms and must accomplish the goal you are given. "
        "Each turn you see the objects in front of you (up to 6 steps ahead and 3 to each side; "
        "walls and closed doors block the view), named with a number, e.g. red ball 1, and the "
        "actions available now. Actions: turn left, turn right, move forward, go to <obj> <id>, "
        "pick up <obj> <id>, go through <door> <id> (an open door), toggle and go through <door> "
        "<id> (a closed door, or a locked door when you carry a key of its color), toggle (the "
        "closed or locked door or the box right in front of you), drop (put down what you carry "
        "in front of you), check available actions. Succeeding earns 1 minus 0.9 times the share "
        "of the step limit used. Reply with one action."
    )
    action_format = "one action from the available actions, e.g. 'go to red ball 1' or 'turn left'"
    default_max_turns = 20  # AgentGym-RL's BabyAI horizon
    reward_range = (0.0, 1.0)
    Options = BabyAIOptions
    # The default level, and AgentGym's 40 (doors, keys, boxes): their actions become single tokens.
    vocabulary_options = ({}, {"level": AGENTGYM_MIX})
    # Measured on the 2-core dev machine (random actions, 100 seeds): reset p50 1.2-1.4 ms on
    # GoToRedBall, PickupLoc and UnlockLocal (p99 ~6 ms), 3.2 ms on BossLevel (p99 12 ms); a step
    # p50 ~0.8 ms (p99 5-10 ms: a long path is many minigrid moves at ~0.2 ms each, then the view
    # and the plan). That is milliseconds, not microseconds: run them on worker threads.
    runs_inline = False
    trusted = True  # ours, and every call is fuzzed by tests/integration/test_fuzz_steps.py

    @classmethod
    def agentgym_task(cls, data_idx: int) -> tuple[int, dict[str, Any] | None]:
        """AgentGym's BabyAI server: level ``data_idx % 40 + 1`` of its list, seed ``data_idx // 40``."""
        return data_idx, {"level": AGENTGYM_MIX}

    def __init__(self) -> None:
        self._world: MiniGridEnv | None = None
        self._level = ""
        self._known: set[tuple[int, int]] = set()
        self._table = ActionTable({}, {})
        self._description = ""

    def reset(self, seed: int, options: BabyAIOptions) -> Observation:
        level = options.level
        if level == AGENTGYM_MIX:
            level, seed = AGENTGYM_LEVELS[seed % len(AGENTGYM_LEVELS)], seed // len(AGENTGYM_LEVELS)
        if self._world is None or level != self._level:
            self.close()
            self._world = gymnasium.make(level).unwrapped
            self._level = level
        self._world.reset(seed=seed)
        first = self.reset_to(self._world)
        first.info["level"] = self._level
        return first

    def reset_to(self, world: MiniGridEnv) -> Observation:
        """Start an episode on an already reset minigrid env (a hand-made grid, a situation under test)."""
        self._world = world
        self._known = set()
        self._observe()
        text = f"Your goal: {world.mission}\n{self._description}\n{action_list(self._table)}"
        return Observation(text, {"mission": world.mission})

    def available_actions(self) -> list[str]:
        return list(self._table.moves)

    def step(self, action: str) -> Step:
        name = normalise(action)
        moves = self._table.moves.get(name)
        if moves is None:
            reason = self._table.refusals.get(name)
            if reason is None:
                named = NAMES_AN_OBJECT.fullmatch(name)
                reason = f"There is no {named[1]} in sight." if named else UNRECOGNISED
            return Step(f"{reason}\n{action_list(self._table)}", 0.0, False, {"valid": False})
        if name == CHECK:
            listed = "You can take the following actions: " + ", ".join(self._table.moves)
            return Step(f"{listed}\n{action_list(self._table)}", 0.0, False, {"valid": True})
        assert self._world is not None
        reward, terminated, truncated = 0.0, False, False
        for move in moves:
            _, move_reward, terminated, truncated, _ = self._world.step(move)
            reward += float(move_reward)
            if terminated or truncated:
                break
        self._observe()
        text = self._description
        info: dict[str, bool] = {"valid": True}
        if terminated or truncated:
            success = terminated and reward > 0
            info["success"] = success
            text += "\n" + (COMPLETED if success else FAILED if terminated else OUT_OF_STEPS)
        return Step(f"{text}\n{action_list(self._table)}", reward, terminated or truncated, info)

    def close(self) -> None:
        if self._world is not None:
            self._world.close()
            self._world = None

    def _observe(self) -> None:
        """Look, remember the cells seen, and recompute the description and the action table."""
        world = self._world
        assert world is not None
        view_grid, visible = world.gen_obs_grid()
        agent_pos = (int(world.agent_pos[0]), int(world.agent_pos[1]))
        view = look(view_grid, visible, agent_pos, world.agent_dir, (world.width, world.height))
        self._known |= view.visible_cells
        walkable = {agent_pos}
        for cell in self._known:
            obj = world.grid.get(*cell)
            if obj is None or (obj.can_overlap() and obj.type != "lava"):
                walkable.add(cell)
        ahead = world.grid.get(*world.front_pos)
        scene = Scene(agent_pos, world.agent_dir, world.carrying, ahead, view.objects, frozenset(walkable))
        self._table = compile_actions(scene)
        self._description = describe(view, world.carrying)
