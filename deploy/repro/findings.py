"""The findings ``stargym repro`` reruns: their arms, and what the papers saw.

An arm is a recipe from ``configs/`` plus ``--set`` overrides; every arm of a finding is trained
from the same random weights on the same seeds, so only the overrides differ. Each finding states
its direction as :class:`Expectation` pairs ("this arm ends higher / collapses later than that
one"), which the report checks against what the runs did; the papers' absolute numbers are for
7B models on GPUs and are not the target.

Rollout cost is held fixed where the papers hold it fixed: a filtered arm keeps ``ratio`` of 16
candidate groups (``groups_per_batch`` = 16 x ratio), so every arm plays 128 episodes an update
and the filter only chooses which of them train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

FROZENLAKE = Path("configs/frozenlake-tiny.yaml")
LAKE_16X8 = (
    "rollout.groups_per_batch=16",
    "rollout.group_size=8",
    "rollout.max_staleness=1",
    "rollout.max_inflight=128",
)
"""The rollout shape every FrozenLake arm plays, first in its overrides: the recipe's until it
became 32 x 4 at staleness 3 (bench/results/learning-wide.json), and what the committed reports
ran, so a rerun plays what they did."""
BANDIT = Path("configs/bandit-tiny.yaml")
SOKOBAN = Path("configs/sokoban-tiny.yaml")

CANDIDATE_GROUPS = 16
"""Groups played per update by every arm (the recipes' ``groups_per_batch``)."""

COLLAPSE_LR = "optim.lr=3e-3"
"""Where FrozenLake collapses: a prototype learned at 2e-3 and collapsed to 0 at 3e-3."""

CRITIC = ("algorithm.advantage=gae", "algorithm.critic.enabled=true")


def vanilla_but(*overrides: str) -> tuple[str, ...]:
    """RAGEN's StarPO (no filter, symmetric clip 0.2, KL 0.001, GRPO advantages), then ``overrides``:
    one component of StarPO-S changed at a time (later keys win). Written out under ``preset:
    custom`` rather than as ``preset: starpo``, which owns those keys and refuses the recipes'
    own ``kl_coef: 0.0``."""
    return (
        "preset=custom",
        "algorithm.advantage=grpo",
        "algorithm.kl_coef=0.001",
        "algorithm.clip_high=0.2",
        "starpo_s.filter.enabled=false",
        *overrides,
    )


VANILLA = vanilla_but()


def kept(ratio: float) -> tuple[str, ...]:
    """The StarPO-S filter keeping ``ratio`` of :data:`CANDIDATE_GROUPS` groups by in-group reward std."""
    return (
        "starpo_s.filter.enabled=true",
        f"starpo_s.filter.ratio={ratio}",
        f"rollout.groups_per_batch={round(CANDIDATE_GROUPS * ratio)}",
    )


STARPO_S = ("preset=starpo_s", *CRITIC, f"rollout.groups_per_batch={round(CANDIDATE_GROUPS * 0.25)}")
"""RAGEN's StarPO-S: filter keeping 25%, clip 0.2/0.28, KL 0, a critic with GAE."""


@dataclass(frozen=True)
class Arm:
    label: str
    config: Path
    overrides: tuple[str, ...] = ()
    minutes: float | None = None
    """Training budget of each run; None: the finding's."""


@dataclass(frozen=True)
class Expectation:
    """The paper's direction for two arms: ``better`` ends with higher held-out success
    (``by="success"``) or collapses in fewer seeds, and later (``by="stability"``), than ``worse``."""

    better: str
    worse: str
    by: Literal["success", "stability"]


@dataclass(frozen=True)
class Finding:
    name: str
    title: str
    paper: str
    """What the paper reported, in a sentence or two."""
    arms: tuple[Arm, ...]
    expectations: tuple[Expectation, ...]
    minutes: float
    """Default training budget per run, chosen so one seed of every arm fits in about an hour here."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """How the setup differs from the paper's, for the report."""

    def arm(self, label: str) -> Arm:
        for arm in self.arms:
            if arm.label == label:
                return arm
        raise KeyError(f"{self.name} has no arm {label!r}; arms: {', '.join(a.label for a in self.arms)}")


ECHO_TRAP = Finding(
    name="echo-trap",
    title="Echo trap: vanilla StarPO collapses, StarPO-S holds",
    paper=(
        "RAGEN: multi-turn RL with vanilla StarPO (no filtering, symmetric clipping, KL 0.001, GRPO) "
        "collapses after early gains: success and in-group reward std fall, entropy collapses and the "
        "gradient norm spikes. StarPO-S (variance filtering keeping 25%, clip-higher 0.2/0.28, no KL, "
        "a critic) delays or prevents the collapse."
    ),
    arms=(
        Arm("starpo", FROZENLAKE, (*LAKE_16X8, COLLAPSE_LR, *VANILLA)),
        Arm("starpo-s", FROZENLAKE, (*LAKE_16X8, COLLAPSE_LR, *STARPO_S)),
    ),
    expectations=(
        Expectation("starpo-s", "starpo", "stability"),
        Expectation("starpo-s", "starpo", "success"),
    ),
    minutes=8.0,
    notes=("FrozenLake 4x4 at lr 3e-3, where the tiny policy is prone to collapse.",),
)

FILTER_RATIO = Finding(
    name="filter-ratio",
    title="Variance filtering: keeping fewer, higher-variance groups trains better",
    paper=(
        "RAGEN: keeping only the groups with the highest in-group reward std (25% or 50%) improves "
        "success and delays collapse against keeping them all."
    ),
    arms=tuple(
        Arm(f"keep-{round(ratio * 100)}", FROZENLAKE, (*LAKE_16X8, COLLAPSE_LR, *kept(ratio)))
        for ratio in (0.25, 0.5, 0.75, 1.0)
    ),
    expectations=(
        Expectation("keep-25", "keep-100", "stability"),
        Expectation("keep-25", "keep-100", "success"),
        Expectation("keep-50", "keep-100", "success"),
    ),
    minutes=6.0,
    notes=("Every arm plays 16 groups of 8 per update; the filter chooses which train.",),
)

LAKE_5X5 = ("envs.mix=[{id: game/frozenlake, options: {size: 5}}]", "eval.max_turns=16")
"""FrozenLake 5x5 (shortest path 8 moves), every arm evaluated on the same 16-turn episodes."""

SCALING_INTER = Finding(
    name="scaling-inter",
    title="ScalingInter-RL: a horizon that starts short and widens",
    paper=(
        "AgentGym-RL: training with a long interaction horizon from the start is unstable and "
        "collapses, a short fixed horizon plateaus, and a horizon that starts short and widens in "
        "stages reaches the best final performance."
    ),
    arms=tuple(
        Arm(label, FROZENLAKE, (*LAKE_16X8, *LAKE_5X5, f"curriculum.horizon_schedule={schedule}"))
        for label, schedule in (
            ("short", "[[0, 1], [20, 8]]"),
            ("long", "[[0, 1], [20, 16]]"),
            ("scaling", "[[0, 1], [20, 8], [100, 12], [160, 16]]"),
        )
    ),
    expectations=(Expectation("scaling", "short", "success"), Expectation("scaling", "long", "success")),
    minutes=10.0,
    notes=(
        "FrozenLake 5x5 (the shortest path is 8 moves); every arm starts with the recipe's one-turn "
        "stage, which teaches valid actions, and is evaluated at 16 turns.",
    ),
)

STARPO_S_ABLATION = Finding(
    name="starpo-s-ablation",
    title="StarPO-S's components, alone and together",
    paper=(
        "RAGEN: each of variance filtering, clip-higher and the critic helps on its own against "
        "vanilla StarPO; together (StarPO-S) they are the most stable."
    ),
    arms=tuple(
        Arm(f"{env}/{label}", config, (*extra, *overrides), minutes)
        for env, config, extra, minutes in (
            ("bandit", BANDIT, (), 3.0),
            ("frozenlake", FROZENLAKE, (*LAKE_16X8, COLLAPSE_LR), 6.0),
        )
        for label, overrides in (
            ("starpo", VANILLA),
            ("filter", vanilla_but(*kept(0.25))),
            ("clip-higher", vanilla_but("algorithm.clip_high=0.28")),
            ("critic", vanilla_but(*CRITIC)),
            ("starpo-s", STARPO_S),
        )
    ),
    expectations=(
        *(
            Expectation(f"{env}/{better}", f"{env}/starpo", "success")
            for env in ("bandit", "frozenlake")
            for better in ("filter", "clip-higher", "critic", "starpo-s")
        ),
        Expectation("frozenlake/starpo-s", "frozenlake/starpo", "stability"),
    ),
    minutes=6.0,
    notes=("FrozenLake at lr 3e-3 as in echo-trap; the bandit at its recipe's lr 2e-3.",),
)

ROLLOUT_SHAPING = Finding(
    name="rollout-shaping",
    title="Rollout shaping: diverse initial states, a few actions per turn, fresh rollouts",
    paper=(
        "RAGEN: at a fixed number of episodes per update, more distinct initial states with fewer "
        "samples each generalise better; allowing a few actions per turn (5 or so) beats one; and "
        "fresh rollouts every update beat rollouts reused from older policies."
    ),
    arms=(
        Arm("states-32x4", FROZENLAKE, (*LAKE_16X8, "rollout.groups_per_batch=32", "rollout.group_size=4")),
        Arm("states-16x8", FROZENLAKE, LAKE_16X8),
        Arm("states-8x16", FROZENLAKE, (*LAKE_16X8, "rollout.groups_per_batch=8", "rollout.group_size=16")),
        *(
            Arm(
                f"actions-{actions}",
                FROZENLAKE,
                (
                    *LAKE_16X8,
                    f"envs.mix=[{{id: game/frozenlake, options: {{size: 4, max_actions_per_turn: {actions}}}}}]",
                    "rollout.action_format=words",
                    f"rollout.sampling.max_tokens={actions}",
                    "algorithm.inverse_probability_advantage=null",
                ),
            )
            for actions in (3, 5)
        ),
        Arm("fresh", FROZENLAKE, (*LAKE_16X8, "rollout.max_staleness=0", "rollout.max_inflight=128")),
        Arm("reused", FROZENLAKE, (*LAKE_16X8, "rollout.max_staleness=3", "rollout.max_inflight=512")),
    ),
    expectations=(
        Expectation("states-32x4", "states-8x16", "success"),
        Expectation("actions-3", "states-16x8", "success"),
        Expectation("actions-5", "states-16x8", "success"),
        Expectation("fresh", "reused", "success"),
    ),
    minutes=5.0,
    notes=(
        "states-16x8 is the recipe as it was (16 x 8 at staleness 1) and the one-action-per-turn arm; "
        "the actions-k arms reply in the words format (up to k moves separated by spaces, k tokens), "
        "the board shown once a turn, and each turn's invalid penalty is the share of its moves the "
        "env rejected. The recipe's 1/pi weighting of one-reply groups is off there: it is meant for "
        "one-token replies, and over k tokens pi spans orders of magnitude, so a group's rarest "
        "sample would take nearly all of its weight.",
        "With RAGEN's || separator instead (2k-1 tokens) no actions arm learnt: from random weights "
        "the tiny policy had to sample a wholly valid multi-action reply before any reply scored "
        "better than another, and it never did (invalid 99-100% of turns in 112-175 updates).",
    ),
)

TURN_CREDIT = Finding(
    name="turn-credit",
    title="Turn-level credit: an advantage per turn against one per episode",
    paper=(
        "GiGPO (verl-agent) and RAGEN's bi-level GAE: crediting each turn (a step-level comparison "
        "of the turns taken in the same state, or GAE whose steps are turns) trains multi-turn "
        "agents better than trajectory-level GRPO, which gives every turn of an episode the same "
        "advantage; GiGPO reported the gain on Sokoban, ALFWorld and WebShop."
    ),
    arms=(
        Arm("grpo", SOKOBAN),
        Arm("gigpo", SOKOBAN, ("algorithm.advantage=gigpo",)),
        Arm("turn-gae", SOKOBAN, ("algorithm.advantage=turn_gae", "algorithm.critic.enabled=true")),
    ),
    expectations=(Expectation("gigpo", "grpo", "success"), Expectation("turn-gae", "grpo", "success")),
    minutes=10.0,
    notes=(
        "Sokoban 6x6 with one box (configs/sokoban-tiny.yaml: one token a reply, a one-turn stage, "
        "then 10 and 15 turns); gamma 1, so a turn's reward-to-go is the rest of its episode's return.",
    ),
)

FINDINGS: dict[str, Finding] = {
    finding.name: finding
    for finding in (ECHO_TRAP, FILTER_RATIO, SCALING_INTER, STARPO_S_ABLATION, ROLLOUT_SHAPING, TURN_CREDIT)
}
