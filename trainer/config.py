"""The training run's configuration: pydantic models of ``configs/*.yaml``.

Every section forbids unknown keys, so a misspelt key is an error that names it and its path
(``algorithm.clip_hgih``) instead of a default silently taking its place. :func:`load_config`
collects *every* problem of a file into one :class:`ConfigError`, each with its YAML path.

The preset switch
-----------------
``preset`` picks the settings that distinguish RAGEN's two variants, so the comparison the paper
makes is one key away:

=====================================  ==================  ===================
key                                    ``preset: starpo``  ``preset: starpo_s``
=====================================  ==================  ===================
``starpo_s.filter.enabled``            false               true
``algorithm.kl_coef``                  0.001               0.0
``algorithm.clip_low``                 0.2                 0.2
``algorithm.clip_high``                0.2 (symmetric)     0.28 (clip-higher)
=====================================  ==================  ===================

With ``preset: custom`` (the default) those four keys take their own values (defaults: filter off,
KL 0, clip 0.2/0.28). With a preset, the preset *owns* them: leaving them out of the file is the
normal way, and writing one with a value that differs from the preset's is an error naming the
key, so flipping ``preset`` alone always gives exactly the variant it names. Everything else
(filter ``ratio``/``mode``, advantage estimator, entropy bonus, ...) stays independent.
"""

from __future__ import annotations

import difflib
import itertools
import math
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.contracts import FAMILY_PORTS
from services.rollout_protocol import AGENT_ENTRY_POINT, RUN_ID_PATTERN, ActionFormat, SamplingParams
from trainer.algorithms.advantages import InverseProbabilityScope
from trainer.algorithms.curriculum import HorizonSchedule
from trainer.algorithms.filtering import num_groups_to_keep
from trainer.algorithms.registry import ADVANTAGE_ESTIMATORS, AdvantageEstimator

DEFAULT_MODEL_PATH = "models/tiny"
CHECKPOINTS_ROOT = "checkpoints"

Preset = Literal["custom", "starpo", "starpo_s"]
PRESETS: dict[str, dict[tuple[str, ...], Any]] = {
    "starpo": {
        ("starpo_s", "filter", "enabled"): False,
        ("algorithm", "kl_coef"): 0.001,
        ("algorithm", "clip_low"): 0.2,
        ("algorithm", "clip_high"): 0.2,
    },
    "starpo_s": {
        ("starpo_s", "filter", "enabled"): True,
        ("algorithm", "kl_coef"): 0.0,
        ("algorithm", "clip_low"): 0.2,
        ("algorithm", "clip_high"): 0.28,
    },
}
"""What each preset sets, by key path; ``custom`` sets nothing."""


class ConfigError(ValueError):
    """A config file that cannot be used; ``problems`` holds ``(yaml path, message)`` pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = [f"{len(problems)} problem(s) in {source}:"]
        lines += [f"  {path or '<top level>'}: {message}" for path, message in problems]
        super().__init__("\n".join(lines))


class _KeyedProblems(ValueError):
    """Raised by cross-field validators so that each problem keeps the path of the key it is about."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --- run, model, envs -----------------------------------------------------------------------


class RunConfig(Section):
    name: str = Field(
        default="run",
        pattern=RUN_ID_PATTERN,
        description="Run id: jobs carry it as run_id, the run's Redis names are under stargym:<name>: "
        "(its workers need the same, `stargym rollout --run`), and it names the run directory.",
    )
    output_dir: str | None = Field(
        default=None, description="Run directory; None: checkpoints/<name>/ relative to the working dir."
    )
    seed: int = Field(default=0, ge=0, description="Seeds python, numpy and torch at the start of the run.")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path(CHECKPOINTS_ROOT) / self.name


class ModelConfig(Section):
    path: str = Field(
        default=DEFAULT_MODEL_PATH,
        description="A *local* Hugging Face causal-LM directory (no hub is reachable: download first).",
    )
    init_tiny_if_missing: bool = Field(
        default=False,
        description="Create the tiny default policy at `path` (as `stargym model init`) when it is absent.",
    )


class SeedRange(Section):
    """Seeds ``start`` (inclusive) to ``stop`` (exclusive); YAML may also write ``[start, stop]``."""

    start: int = Field(ge=0)
    stop: int = Field(gt=0)

    @model_validator(mode="before")
    @classmethod
    def from_pair(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            if len(value) != 2:
                raise ValueError(f"a seed range is [start, stop], got {len(value)} item(s)")
            return {"start": value[0], "stop": value[1]}
        return value

    @model_validator(mode="after")
    def ordered(self) -> Self:
        if self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be greater than start ({self.start})")
        return self

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, seed: object) -> bool:
        return isinstance(seed, int) and self.start <= seed < self.stop

    def overlaps(self, other: SeedRange) -> bool:
        return self.start < other.stop and other.start < self.stop


class MixEnv(Section):
    """One env of the training mix (not the env server's wire ``EnvSpec``, which describes an env)."""

    id: str = Field(pattern=r"^[a-z0-9_]+/[A-Za-z0-9_.-]+$", description="Env id, e.g. 'game/frozenlake'.")
    weight: float = Field(default=1.0, gt=0, description="Share of new groups drawn from this env.")
    options: dict[str, Any] | None = Field(default=None, description="Env options passed at create.")
    eval_options: dict[str, Any] | None = Field(
        default=None,
        description="Options held-out evaluation overrides, key by key, e.g. {split: dev} for an env "
        "whose options pick its data split: held-out seeds alone would replay training questions.",
    )
    url: str | None = Field(default=None, description="Env server of this env; None: `envs.servers[family]`.")

    @property
    def family(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def held_out_options(self) -> dict[str, Any] | None:
        """The options of evaluation: ``options`` with ``eval_options``' keys replaced or added."""
        if self.eval_options is None:
            return self.options
        return (self.options or {}) | self.eval_options


class EnvsConfig(Section):
    mix: list[MixEnv] = Field(
        default_factory=lambda: [MixEnv(id="game/frozenlake")], min_length=1, description="Env mix."
    )
    servers: dict[str, str] = Field(
        default_factory=dict,
        description="Env server URL by family; a family not listed: http://127.0.0.1:<its default port>.",
    )
    train_seeds: SeedRange = Field(default_factory=lambda: SeedRange(start=0, stop=1_000_000))
    eval_seeds: SeedRange = Field(
        default_factory=lambda: SeedRange(start=1_000_000, stop=1_000_256),
        description="Held-out seeds: must not overlap train_seeds.",
    )

    @model_validator(mode="after")
    def consistent(self) -> Self:
        problems: list[tuple[str, str]] = []
        if self.train_seeds.overlaps(self.eval_seeds):
            problems.append(("eval_seeds", "held-out eval seeds overlap train_seeds"))
        seen: set[str] = set()
        for index, env in enumerate(self.mix):
            if env.id in seen:
                problems.append((f"mix[{index}].id", f"{env.id!r} is listed twice"))
            seen.add(env.id)
        if problems:
            raise _KeyedProblems(problems)
        return self

    def url_for(self, env_id: str) -> str:
        """The env server that serves ``env_id``: the env's own url, its family's, or the default port."""
        for env in self.mix:
            if env.id == env_id and env.url:
                return env.url
        family = env_id.split("/", 1)[0]
        if family in self.servers:
            return self.servers[family]
        if family not in FAMILY_PORTS:
            raise KeyError(f"no env server URL for family {family!r}: set envs.servers.{family}")
        return f"http://127.0.0.1:{FAMILY_PORTS[family]}"


# --- rollout, algorithm, StarPO-S, curriculum -------------------------------------------------


class RolloutConfig(Section):
    group_size: int = Field(default=8, ge=1, description="Jobs per group (same env and seed).")
    groups_per_batch: int = Field(default=16, ge=1, description="Groups per update batch.")
    max_inflight: int | None = Field(
        default=None,
        ge=1,
        description="Most jobs issued and not yet used (queued, played, or waiting in a complete group); "
        "None: what max_staleness admits, max_staleness + 1 batches (see TrainConfig.issue_limit).",
    )
    group_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="A group not complete this long after it was issued has its missing jobs re-issued "
        "once; still incomplete as long again, it is dropped (rollout/groups_timed_out).",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        description="Admission control: new groups are issued only while fewer than max_staleness + 1 "
        "batches of candidate groups are issued and not yet trained, so a trajectory is trained at most "
        "this many policy versions after the one it was issued under, unless its episode outlasts others "
        "(it is then trained older, never dropped: the PPO ratio against its behaviour log-probs "
        "corrects for the lag; counted in rollout/trained_stale).",
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Per-turn sampling.")
    action_format: ActionFormat = Field(
        default="plain", description="plain | words | answer_tags (rollout_server/actions.py)"
    )
    history_turns: int | None = Field(
        default=None,
        ge=0,
        description="Earlier turns (observation and reply) each prompt keeps, in training and held-out "
        "evaluation alike; 0: the instruction and the current observation only (a Markov prompt). "
        "Past the window each turn is trained as a sequence of its own. None: the whole episode.",
    )
    agent: str | None = Field(
        default=None,
        pattern=AGENT_ENTRY_POINT,
        description="Your own agent plays every episode (training and evaluation) through the worker's "
        "recording OpenAI-compatible proxy: 'package.module:function' (an async function given an "
        "openai.AsyncOpenAI client, the task and the env) or an outside harness's http(s) URL. None: "
        "the worker's own loop (instruction, action_format, reply parsing).",
    )
    max_model_len: int | None = Field(default=None, gt=0, description="Context limit; None: the engine's.")
    invalid_penalty: float = Field(
        default=0.0,
        le=0,
        description="Added by the trainer to an episode's return, times the share of its turns the env "
        "judged invalid (plain format has no format penalty of its own); 0: off.",
    )

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_batch

    @model_validator(mode="after")
    def history_is_the_loops(self) -> Self:
        if self.agent is not None and self.history_turns is not None:
            raise _KeyedProblems(
                [
                    (
                        "history_turns",
                        "shapes the worker's own loop; with rollout.agent your agent keeps its history",
                    )
                ]
            )
        return self


class CriticConfig(Section):
    enabled: bool = False
    path: str | None = Field(
        default=None, description="Separate critic model dir; None: value head on the policy."
    )
    lr: float = Field(default=1e-5, gt=0)
    value_clip: float | None = Field(default=0.5, gt=0, description="None: no value clipping.")


class AlgorithmConfig(Section):
    advantage: str = Field(
        default="grpo",
        description="Advantage estimator, a name in trainer.algorithms.registry: gae, grpo, rloo, "
        "reinforce_pp, the turn-level turn_gae (GAE over turns, needs the critic) and gigpo (GRPO plus "
        "a comparison of the group's turns taken in the same observation), or one registered with "
        "register_advantage.",
    )
    norm_adv: Literal["group", "batch", "none"] = Field(
        default="group", description="Advantage normaliser: per-group std (GRPO), batch std, or none."
    )
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=1.0, ge=0, le=1)
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    clip_high: float = Field(default=0.28, gt=0)
    dual_clip: float | None = Field(default=3.0, gt=1, description="Dual-clip c; None: off.")
    entropy_coef: float = Field(default=0.001, ge=0)
    kl_coef: float = Field(default=0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    ppo_epochs: int = Field(default=1, ge=1)
    bootstrap_truncated: bool | None = Field(
        default=None,
        description="Bootstrap an episode cut by max_turns or the context limit from the critic's "
        "value of the state it was cut in, instead of treating it as ended (value 0). null: on for "
        "an estimator with a critic (gae); true with an estimator without one is an error.",
    )
    whiten_advantages: bool | None = Field(
        default=None,
        description="Whiten the advantages (mean 0, std 1 over the batch's trainable tokens). null: "
        "the estimator's default: on for gae (as verl does), off for grpo and rloo (normalised "
        "within groups) and reinforce_pp (whitened by definition).",
    )
    share_duplicate_advantage: bool = Field(
        default=False,
        description="Identical episodes of a group (the same tokens) split one advantage between "
        "them instead of each taking it whole, so a reply is not reinforced in proportion to how "
        "often it was sampled (trainer.algorithms.advantages.duplicate_shares).",
    )
    inverse_probability_advantage: InverseProbabilityScope | None = Field(
        default=None,
        description="Push equally good short replies alike however likely they are: centre the "
        "advantages of a group's first replies on their 1/π-weighted mean and scale each by 1 / "
        "its behaviour probability, normalised over the group, so they keep their ratio "
        "(trainer.algorithms.advantages.inverse_probability_advantages). one_reply: only groups "
        "whose episodes are one reply each (a one-turn stage of the horizon schedule, a bandit); "
        "first_reply: also the first turn of multi-turn groups (one start state per group), whose "
        "later turns keep their advantages; null: off. The tokens it weighs take it instead of "
        "share_duplicate_advantage.",
    )
    critic: CriticConfig = Field(default_factory=CriticConfig)

    @field_validator("advantage")
    @classmethod
    def registered_estimator(cls, name: str) -> str:
        if name not in ADVANTAGE_ESTIMATORS:
            known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
            raise ValueError(f"unknown estimator {name!r}; registered: {known}")
        return name

    @model_validator(mode="after")
    def critic_when_needed(self) -> Self:
        problems = []
        if self.estimator.needs_critic and not self.critic.enabled:
            problems.append(
                ("critic.enabled", f"advantage {self.advantage!r} needs a critic: set critic.enabled: true")
            )
        if self.bootstrap_truncated and not self.estimator.needs_critic:
            problems.append(
                (
                    "bootstrap_truncated",
                    f"advantage {self.advantage!r} has no critic to bootstrap from: "
                    "use an estimator with a critic (gae) or leave bootstrap_truncated unset",
                )
            )
        if problems:
            raise _KeyedProblems(problems)
        return self

    @property
    def estimator(self) -> AdvantageEstimator:
        """The registered estimator ``advantage`` names."""
        return ADVANTAGE_ESTIMATORS[self.advantage]

    @property
    def bootstraps_truncated(self) -> bool:
        """``bootstrap_truncated`` with null resolved: on exactly when the estimator has a critic."""
        if self.bootstrap_truncated is None:
            return self.estimator.needs_critic
        return self.bootstrap_truncated

    @property
    def whitens_advantages(self) -> bool:
        """``whiten_advantages`` with null resolved to the estimator's default."""
        if self.whiten_advantages is None:
            return self.estimator.whiten_by_default
        return self.whiten_advantages


class FilterConfig(Section):
    enabled: bool = False
    ratio: float = Field(default=0.25, gt=0, le=1, description="Share of groups kept (RAGEN: 0.25).")
    mode: Literal["std", "std_rev"] = Field(
        default="std", description="std: keep the highest in-group reward std; std_rev: the lowest."
    )


class StarPOSConfig(Section):
    filter: FilterConfig = Field(default_factory=FilterConfig)


class CurriculumConfig(Section):
    horizon_schedule: list[tuple[int, int]] = Field(
        default_factory=lambda: [(0, 10)],
        description="ScalingInter-RL: [[update step, max turns], ...], from step 0, steps increasing.",
    )

    @field_validator("horizon_schedule")
    @classmethod
    def valid_schedule(cls, schedule: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if not schedule:
            raise ValueError("needs at least one stage, e.g. [[0, 10]]")
        if schedule[0][0] != 0:
            raise ValueError(f"the first stage must start at step 0, not {schedule[0][0]}")
        for (step, _), (next_step, _) in itertools.pairwise(schedule):
            if next_step <= step:
                raise ValueError(f"steps must increase: {next_step} follows {step}")
        bad = [turns for _, turns in schedule if turns < 1]
        if bad:
            raise ValueError(f"max turns must be >= 1, got {bad[0]}")
        return schedule

    @property
    def schedule(self) -> HorizonSchedule:
        """The schedule as :class:`trainer.algorithms.curriculum.HorizonSchedule` (max turns, stages)."""
        return HorizonSchedule([list(stage) for stage in self.horizon_schedule])


# --- optimisation, checkpoints, metrics, services ---------------------------------------------


class OptimConfig(Section):
    lr: float = Field(default=1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW; 0 makes it Adam.")
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int = Field(default=200, ge=1, description="Updates in the run (and the cosine length).")
    grad_clip: float | None = Field(default=1.0, gt=0, description="Max gradient norm; None: no clipping.")
    micro_batch_tokens: int = Field(
        default=8192,
        ge=1,
        description="The most padded tokens (rows x length) one micro-batch may hold: the memory cap. "
        "Within it, rows are split by length where the padding saved is worth another pass.",
    )
    bf16: Literal["auto", True, False] = Field(
        default="auto",
        description="bf16 autocast of the forwards; auto: on a GPU, and on a CPU with AMX (Sapphire Rapids on).",
    )
    gradient_checkpointing: bool = False

    @field_validator("betas")
    @classmethod
    def valid_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {list(betas)}")
        return betas


class CheckpointConfig(Section):
    save_every: int = Field(default=10, ge=1, description="Save a checkpoint every this many updates.")
    keep_last: int = Field(default=3, ge=1, description="Checkpoints kept; older ones are deleted.")
    keep_policies: int = Field(default=3, ge=1, description="Published policy-v<N> dirs kept.")


class WandbConfig(Section):
    enabled: bool = False
    project: str = "stargym"
    mode: Literal["offline", "online"] = "offline"


class MetricsConfig(Section):
    """JSONL (``<run_dir>/metrics.jsonl``) is always written; these add optional sinks."""

    tensorboard: bool = Field(default=False, description="Needs the optional `tensorboard` package.")
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class DashboardConfig(Section):
    """The trainer's HTTP service: /health, /metrics and /status always, the dashboard at / when enabled."""

    enabled: bool = Field(default=True, description="Serve the dashboard (trainer/dashboard/) at /.")
    host: str = "127.0.0.1"
    port: int = Field(default=8300, ge=1, le=65535)


class EvalConfig(Section):
    episodes: int = Field(default=256, ge=0, description="Held-out episodes per evaluation.")
    every: int = Field(default=50, ge=0, description="Evaluate every this many updates; 0: only at the end.")
    temperature: float = Field(
        default=1.0, ge=0, description="Sampling temperature of evaluation; 0: greedy."
    )
    max_turns: int | None = Field(
        default=None,
        ge=1,
        description="Turn limit of held-out episodes; None: the horizon schedule's last stage. Set it "
        "to compare runs with different schedules on the same episodes.",
    )
    stop_at_success: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="End the run, as total_steps would, once an evaluation between updates (eval.every) "
        "reaches this held-out success with no episode missing; None: never. For runs that measure the "
        "time to a target, and for tests that need a learnt policy, not a fixed budget.",
    )

    @model_validator(mode="after")
    def stopping_needs_rounds(self) -> Self:
        if self.stop_at_success is not None and not self.every:
            raise _KeyedProblems(
                [("stop_at_success", "needs eval.every > 0: only the rounds between updates can end a run")]
            )
        return self


# --- the whole run ----------------------------------------------------------------------------


class TrainConfig(Section):
    preset: Preset = Field(default="custom", description="starpo | starpo_s | custom; see the module doc.")
    hardware: str = Field(default="CPU", description="What the recipe expects, e.g. '8x A100 80GB'.")
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    envs: EnvsConfig = Field(default_factory=EnvsConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    starpo_s: StarPOSConfig = Field(default_factory=StarPOSConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def apply_preset(self) -> Self:
        """Set what the preset owns; an explicit conflicting value is an error (see module doc)."""
        if self.preset == "custom":
            return self
        problems: list[tuple[str, str]] = []
        for path, value in PRESETS[self.preset].items():
            parent = self
            for key in path[:-1]:
                parent = getattr(parent, key)
            explicit = path[-1] in parent.model_fields_set
            if explicit and getattr(parent, path[-1]) != value:
                problems.append(
                    (
                        ".".join(path),
                        f"{getattr(parent, path[-1])!r} conflicts with preset {self.preset!r}, which sets "
                        f"{value!r}: remove the key, or set preset: custom",
                    )
                )
            else:
                setattr(parent, path[-1], value)
                parent.model_fields_set.discard(path[-1])  # keeps the preset switchable
        if problems:
            raise _KeyedProblems(problems)
        return self

    @model_validator(mode="after")
    def inflight_fits_a_batch(self) -> Self:
        """Derive ``rollout.max_inflight`` when unset; refuse one that could never yield a batch.

        Complete groups waiting for a batch still hold their slots, so the controller can only
        cut a batch if :attr:`min_inflight` jobs fit in flight at once: below that it would wait
        forever. Unset, the limit is what ``max_staleness`` admits (:attr:`issue_limit`): with the
        default of 1, one batch of candidates being played while the previous one trains, which
        keeps workers busy (with the filter off and defaults: 2 x 16 x 8 = 256). Runs after
        :meth:`apply_preset`, which decides whether the StarPO-S filter is on.
        """
        minimum = self.min_inflight
        if self.rollout.max_inflight is None:
            self.rollout.max_inflight = self.staleness_limit
            self.rollout.model_fields_set.discard("max_inflight")  # stays derived in to_yaml's eyes
        elif self.rollout.max_inflight < minimum:
            if self.starpo_s.filter.enabled:
                why = (
                    f"rollout.groups_per_batch={self.rollout.groups_per_batch} kept groups need "
                    f"{self.candidate_groups} candidate groups at starpo_s.filter.ratio="
                    f"{self.starpo_s.filter.ratio}"
                )
            else:
                why = f"rollout.groups_per_batch={self.rollout.groups_per_batch} groups"
            raise _KeyedProblems(
                [
                    (
                        "rollout.max_inflight",
                        f"{self.rollout.max_inflight} jobs can never fill a batch: {why} of "
                        f"rollout.group_size={self.rollout.group_size} jobs must be in flight at once, "
                        f"so the minimum is {minimum}; raise it or leave it out (derived: {self.staleness_limit})",
                    )
                ]
            )
        return self

    @property
    def candidate_groups(self) -> int:
        """Complete groups one batch is cut from: ``groups_per_batch``, or with the StarPO-S filter
        the fewest whose kept share (``filter.ratio``) is ``groups_per_batch``."""
        wanted = self.rollout.groups_per_batch
        flt = self.starpo_s.filter
        if not flt.enabled:
            return wanted
        needed = math.ceil(round(wanted / flt.ratio, 6))
        while num_groups_to_keep(needed, flt.ratio) < wanted:
            needed += 1
        return needed

    @property
    def min_inflight(self) -> int:
        """The smallest ``rollout.max_inflight`` that can ever produce a batch."""
        return self.candidate_groups * self.rollout.group_size

    @property
    def staleness_limit(self) -> int:
        """Jobs ``rollout.max_staleness`` admits in flight: ``max_staleness + 1`` batches of candidates.

        As AReaL bounds staleness: when groups are trained in the order they were issued, a
        batch is cut from the oldest ``candidate_groups`` groups, so with at most ``K + 1`` batches
        issued and not yet trained, a group issued under version ``v`` is trained by version
        ``v + K``. Issuing is what is held back; nothing is dropped for its age.
        """
        return (self.rollout.max_staleness + 1) * self.min_inflight

    @property
    def issue_limit(self) -> int:
        """Jobs the controller lets be in flight: ``rollout.max_inflight``, at most :attr:`staleness_limit`."""
        assert self.rollout.max_inflight is not None  # derived by the validator
        return min(self.rollout.max_inflight, self.staleness_limit)

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir

    @property
    def eval_max_turns(self) -> int:
        """Turn limit of held-out episodes: ``eval.max_turns``, else the schedule's last stage."""
        return self.eval.max_turns or self.curriculum.schedule.final_max_turns

    @classmethod
    def from_dict(cls, data: Any, source: str = "<config>") -> TrainConfig:
        """Validate ``data``; every problem is reported in one :class:`ConfigError`."""
        if not isinstance(data, dict):
            raise ConfigError(source, [("", f"the config must be a mapping, got {type(data).__name__}")])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(source, _problems(exc)) from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read and validate a YAML config; ``overrides`` maps dotted keys to values (``{"optim.lr": 1e-4}``)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read the file: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [("", f"not valid YAML: {exc}")]) from None
    if data is None:
        data = {}
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value, source)
    return TrainConfig.from_dict(data, source)


def _set_dotted(data: Any, dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = data
    for index, key in enumerate(keys[:-1]):
        if not isinstance(node, dict):
            raise ConfigError(source, [(".".join(keys[:index]), "is not a section")])
        node = node.setdefault(key, {})
    if not isinstance(node, dict):
        raise ConfigError(source, [(".".join(keys[:-1]), "is not a section")])
    node[keys[-1]] = value


def _format_loc(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model whose fields live at ``loc`` (to suggest a key for a misspelt one)."""
    model: Any = TrainConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = (
            model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        )
        if field is None:
            return None
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        elif args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            model = args[0]  # list[MixEnv]
        else:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, _KeyedProblems):
            prefix = _format_loc(loc)
            for path, message in cause.problems:
                problems.append((f"{prefix}.{path}" if prefix else path, message))
            continue
        if error["type"] == "extra_forbidden":
            message = "unknown key"
            model = _model_at(loc[:-1])
            if model is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
                if close:
                    message += f" (did you mean {close[0]!r}?)"
                else:
                    message += f"; allowed: {', '.join(model.model_fields)}"
            problems.append((_format_loc(loc), message))
            continue
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] not in ("missing",) and "input" in error and not isinstance(error["input"], dict):
            message += f" (got {error['input']!r})"
        problems.append((_format_loc(loc), message))
    return problems
