"""Pydantic models of what travels through Redis between the trainer and the rollout workers.

One definition of the rollout job, the trajectory and the policy pointer, and of the Redis names
they live under (docs/architecture.md, "Rollout job and trajectory", "Delivery", "Weights"). Every stream
entry carries a single field, :data:`DATA_FIELD`, holding the model's JSON; unknown fields are a
validation error so that a producer and a consumer that disagree fail loudly instead of training
on silently dropped data.
"""

from __future__ import annotations

import itertools
import operator
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Self

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.env_protocol import Seed, WireModel

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""What a run id may be: it is part of every Redis name of the run and names its directory."""
ROLLOUT_GROUP = "rollout"
"""Consumer group of the rollout workers on :attr:`RunKeys.jobs`."""
TRAINER_GROUP = "trainer"
"""Consumer group of the trainer on :attr:`RunKeys.trajectories`."""
DEAD_LETTER_SUFFIX = ":dead"
"""Entries that cannot be parsed, and poison jobs, are moved to ``<stream>:dead`` with the reason."""
DATA_FIELD = "data"
"""The one field of every stream entry: the model's JSON."""
WORKER_ENTRY_MAX_AGE_S = 3600.0
"""Registry fields not rewritten for this long are deleted by the next worker that writes its own,
so the hash stays bounded however many workers crash."""


@dataclass(frozen=True)
class RunKeys:
    """The Redis names of one run, all under ``stargym:<run_id>:``: several runs share one Redis
    and none sees another's jobs, trajectories, policy or workers. A worker serves one run (it
    loads that run's policy), so it is started with the run id, as the trainer is."""

    run_id: str

    def __post_init__(self) -> None:
        if not re.fullmatch(RUN_ID_PATTERN, self.run_id):
            raise ValueError(f"run id {self.run_id!r} does not match {RUN_ID_PATTERN}")

    @property
    def prefix(self) -> str:
        return f"stargym:{self.run_id}:"

    @property
    def jobs(self) -> str:
        """Stream of :class:`RolloutJob`, written by the trainer's controller, read by rollout workers."""
        return self.prefix + "jobs"

    @property
    def trajectories(self) -> str:
        """Stream of :class:`Trajectory`, written by rollout workers, read by the trainer."""
        return self.prefix + "trajectories"

    @property
    def policy(self) -> str:
        """Hash ``{version, path}``: the newest published policy (see :class:`PolicyPointer`)."""
        return self.prefix + "policy"

    @property
    def policy_updates(self) -> str:
        """Pub/sub channel; each message is a :class:`PolicyPointer` as JSON."""
        return self.prefix + "policy-updates"

    @property
    def workers(self) -> str:
        """Hash ``{worker_id: WorkerHeartbeat JSON}``: the registry of the run's rollout workers, so
        the dashboard finds every worker, and through them every env server and engine, without
        being told their URLs. Each worker rewrites its field every ``heartbeat_s`` and deletes it
        on a clean stop; a crashed worker's field stays, its ``updated_at`` ageing, until a live
        worker prunes it (:data:`WORKER_ENTRY_MAX_AGE_S`)."""
        return self.prefix + "workers"

    def done(self, job_id: str) -> str:
        """Exists once that job's trajectory is in the stream (deduplication)."""
        return f"{self.prefix}done:{job_id}"

    @staticmethod
    def workers_pattern() -> str:
        """``SCAN`` pattern of every run's worker registry: how a trainer whose run has no worker
        finds the runs that do."""
        return "stargym:*:workers"

    @staticmethod
    def run_of_workers_key(key: str) -> str:
        return key.removeprefix("stargym:").removesuffix(":workers")


ActionFormat = Literal["plain", "words", "answer_tags"]
JobKind = Literal["env", "agent"]
AGENT_PULL = "pull"
"""The agent of jobs that outside harnesses take from a worker themselves (``POST /sessions``)."""
AGENT_ENTRY_POINT = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$|^https?://\S+$|^pull$"
"""An agent: ``package.module:function`` (run in the worker), an http(s) URL (an outside harness the
worker sends each episode to), or ``pull`` (outside harnesses take episodes by REST)."""


class RolloutWireModel(WireModel):
    """Forbids unknown fields (inherited) and NaN/inf, which JSON cannot carry faithfully."""

    model_config = ConfigDict(allow_inf_nan=False)


class SamplingParams(RolloutWireModel):
    """How every turn of the episode is sampled; the names are the engine protocol's (vLLM's)."""

    temperature: float = Field(default=1.0, ge=0.0, description="0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, description="None: no top-k cut.")
    max_tokens: int = Field(default=256, gt=0, description="Per turn, not per episode.")
    seed: int | None = Field(
        default=None, ge=0, description="Base seed of the episode's sampling; None: engine's choice."
    )


class JobFields(RolloutWireModel):
    """The fields a trajectory repeats from its job, so the trainer needs nothing but the trajectory."""

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1)
    run_id: str = Field(
        pattern=RUN_ID_PATTERN, description="The run: its Redis names are under stargym:<run_id>:."
    )
    env: str = Field(description="An env id such as 'game/frozenlake'.", min_length=1)
    seed: Seed = Field(description="Env seed: same seed, same initial state.")
    group_id: str = Field(min_length=1, description="Jobs of one group share the initial state (GRPO).")
    max_turns: int = Field(gt=0, description="From the ScalingInter-RL horizon schedule.")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    policy_version: int = Field(ge=0)
    action_format: ActionFormat | None = Field(default=None, description="None: the env's own action format.")
    history_turns: int | None = Field(
        default=None,
        ge=0,
        description="The worker's own loop: how many earlier turns (observation and reply) each prompt "
        "keeps before the current observation; the instruction always leads the oldest kept one. None: "
        "the whole episode (one growing sequence). Past the window every turn's prompt is a new sequence "
        "(Trajectory.segments); 0 is a prompt of the instruction and the current observation alone.",
    )
    options: dict[str, Any] | None = Field(default=None, description="Env options passed at create.")
    created_at: float = Field(default_factory=time.time, description="Unix time the job was issued.")
    agent: str | None = Field(
        default=None,
        pattern=AGENT_ENTRY_POINT,
        description="None: the worker plays the episode with its own loop (instruction, reply parsing, "
        "env steps). Else the user's agent plays it through the worker's recording OpenAI-compatible "
        "proxy, one session per episode (rollout_server.agent): 'package.module:function', an async function the worker calls "
        "with an openai.AsyncOpenAI client of the episode's session, the task and the env; the "
        "http(s) URL of an outside harness, which the worker POSTs the session to; or 'pull': an "
        "outside harness takes the session with POST /sessions on the worker.",
    )

    @property
    def kind(self) -> JobKind:
        """``agent`` when the user's agent plays the episode, ``env`` when the worker's own loop does."""
        return "env" if self.agent is None else "agent"

    @model_validator(mode="after")
    def _history_is_the_loops(self) -> Self:
        if self.agent is not None and self.history_turns is not None:
            raise ValueError("history_turns shapes the worker's own loop; an agent keeps its own history")
        return self


class RolloutJob(JobFields):
    """One episode to play: what the controller puts on :attr:`RunKeys.jobs`.

    ``policy_version`` is the version the controller expected to be served when it issued the
    job; the trajectory reports the one actually used.
    """


class Turn(RolloutWireModel):
    """One exchange: the observation the model answered, what it sampled, and what the env did."""

    observation: str = Field(description="The env text the model saw before this response.")
    response: str = Field(description="The decoded sampled text.")
    actions: list[str] = Field(
        default_factory=list,
        description="Actions parsed from the response, in the order sent to the env. 'plain' gives "
        "one; 'words' and 'answer_tags' up to max_actions_per_turn; empty when nothing parsed.",
    )
    reward: float = Field(description="Sum of the env rewards of this turn's actions, with penalties.")
    done: bool
    valid: bool = Field(description="False when the env rejected an action or nothing parsed.")
    invalid_actions: int = Field(
        default=0,
        ge=0,
        description="How many of 'actions' the env rejected; 0 for a valid turn, and for an invalid "
        "one that sent no action (nothing parsed).",
    )
    policy_version: int = Field(ge=0, description="Version of the weights this response was sampled under.")
    prompt_tokens: int = Field(
        ge=0, description="Tokens appended before the response (observation, chat template); loss mask 0."
    )
    response_tokens: int = Field(ge=0, description="Sampled tokens of this turn; loss mask 1.")

    @model_validator(mode="after")
    def _invalid_actions_counted(self) -> Self:
        if self.invalid_actions > len(self.actions):
            raise ValueError(
                f"invalid_actions ({self.invalid_actions}) exceeds the turn's {len(self.actions)} actions"
            )
        if self.valid and self.invalid_actions:
            raise ValueError("a valid turn has no invalid actions")
        return self

    @property
    def invalid_share(self) -> float:
        """The part of this turn that was invalid: 0 when valid, the share of its actions the env
        rejected, or 1 when it sent none (nothing parsed) or the env gave no count."""
        if self.valid:
            return 0.0
        if self.invalid_actions:
            return self.invalid_actions / len(self.actions)
        return 1.0


class Trajectory(JobFields):
    """A played episode: what a rollout worker puts on :attr:`RunKeys.trajectories`.

    Token-level fields are aligned, one entry per token of the whole episode context:
    ``token_ids`` are the exact ids in the context (never re-tokenised text), ``loss_mask`` is 1
    on sampled (assistant) tokens and 0 elsewhere, and ``logprobs`` holds the behaviour
    log-probability of each sampled token and exactly 0.0 on every token with mask 0. Keeping
    one length for the three lets the trainer build its tensors without bookkeeping.

    ``truncated`` episodes (cut by ``max_turns`` or the context limit, not ended by the env) keep
    the env's next observation after their last reply, appended exactly as a next turn would
    append it (closing text, user message, generation prompt; mask 0, log-prob 0.0), even past the
    engine's context: a truncated trajectory's tokens after its last sampled token are the state
    it was cut in; the trainer bootstraps V there. An episode the env ended has none.

    ``policy_version`` is the *oldest* version any turn was sampled under, so that staleness
    checks are conservative when weights changed mid-episode.

    ``text_only`` trajectories (evaluation through an OpenAI-compatible chat endpoint) have no
    token-level fields at all; the trainer learns only from those whose :attr:`trainable` is true.
    """

    turns: list[Turn] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    reward: float = Field(default=0.0, description="Episode return: the sum of the turn rewards.")
    success: bool = False
    num_turns: int = Field(default=0, ge=0)
    truncated: bool = Field(
        default=False, description="Ended by the context limit or max_turns, not by the env."
    )
    error: str | None = Field(default=None, description="Why the episode failed; None when it did not.")
    timings: dict[str, float] = Field(
        default_factory=dict, description="Seconds, e.g. 'total_s', 'generate_s', 'env_s', 'queue_wait_s'."
    )
    worker_id: str = Field(min_length=1)
    env_server: str | None = Field(
        default=None, description="The env server the episode's last attempt ran on (its URL)."
    )
    rerun_after: list[str] = Field(
        default_factory=list,
        description="Why each earlier attempt was abandoned and the episode played again, oldest "
        "first, each naming the server that failed (an env server that died, an engine that stopped "
        "answering).",
    )
    segments: list[int] = Field(
        default_factory=list,
        description="The token index where each sequence after the first starts. An agent that "
        "rewrote its history (dropped or summarised turns), or the worker's loop past its "
        "history_turns window, sent a prompt that does not extend the tokens so far; from there the "
        "tokens are a new sequence (its whole prompt, mask 0, then its replies), which the trainer "
        "trains as a row of its own. Empty: one sequence.",
    )
    text_only: bool = Field(
        default=False,
        description="Played by a text-only engine (an OpenAI-compatible chat endpoint, for evaluation): "
        "token_ids, loss_mask and logprobs are empty, and each turn's prompt_tokens/response_tokens are "
        "the token counts the API reported. Never trainable (see `trainable`).",
    )

    @property
    def untrainable_reason(self) -> str | None:
        """Why the trainer must not learn from this trajectory; None when it may.

        A text-only trajectory has no sampled token ids and no behaviour log-probs, so neither
        the policy gradient nor the PPO ratio can be computed; a failed episode (``error``) has
        no complete outcome to reward.
        """
        if self.text_only:
            return "text-only trajectory (OpenAI-compatible chat engine): no token ids or behaviour log-probs"
        if self.error is not None:
            return f"the episode failed: {self.error}"
        return None

    @property
    def trainable(self) -> bool:
        """What the trainer checks before using a trajectory; see :attr:`untrainable_reason`."""
        return self.untrainable_reason is None

    @classmethod
    def from_job(cls, job: RolloutJob, **results: Any) -> Self:
        """The job's fields plus ``results``; ``results`` may override ``policy_version``."""
        return cls.model_validate({**job.model_dump(), **results})

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids, loss_mask and logprobs must have one length; got {n}, "
                f"{len(self.loss_mask)}, {len(self.logprobs)}"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise ValueError("loss_mask holds only 0 and 1")
        # compress/map/any run in C: a Python generator here took 30% of the trainer's read of a
        # 4 KB trajectory (bench/load.py: 3,985 -> 4,374 trajectories/s read by one consumer).
        if any(itertools.compress(self.logprobs, map(operator.not_, self.loss_mask))):
            raise ValueError("logprobs must be 0.0 where loss_mask is 0")
        if self.text_only and n:
            raise ValueError("a text-only trajectory carries no token_ids, loss_mask or logprobs")
        bounds = [0, *self.segments, n]
        if self.segments and any(start >= end for start, end in itertools.pairwise(bounds)):
            raise ValueError(f"segments must rise strictly inside (0, {n}); got {self.segments}")
        if self.num_turns != len(self.turns):
            raise ValueError(f"num_turns is {self.num_turns} but there are {len(self.turns)} turns")
        if self.num_turns > self.max_turns:
            raise ValueError(f"num_turns {self.num_turns} exceeds max_turns {self.max_turns}")
        sampled = sum(turn.response_tokens for turn in self.turns)
        if not self.text_only and sampled != sum(self.loss_mask):
            raise ValueError(f"turns sampled {sampled} tokens but loss_mask covers {sum(self.loss_mask)}")
        if self.turns and self.policy_version != min(turn.policy_version for turn in self.turns):
            raise ValueError("policy_version must be the oldest version any turn was sampled under")
        return self


class PolicyPointer(RolloutWireModel):
    """The newest published policy: hash :attr:`RunKeys.policy` holds its fields as strings."""

    version: int = Field(ge=0)
    path: str = Field(min_length=1, description="A 'policy-v<N>/' directory in Hugging Face layout.")

    def to_hash(self) -> dict[str, str]:
        return {"version": str(self.version), "path": self.path}

    @classmethod
    def from_hash(cls, fields: dict[bytes | str, bytes | str]) -> Self:
        """Parse an ``HGETALL`` reply, whether the client decodes responses or not."""
        text = {_text(key): _text(value) for key, value in fields.items()}
        return cls.model_validate(text)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class EngineStatus(BaseModel):
    """One engine as a rollout worker sees it (part of :class:`WorkerStatus`)."""

    url: str
    policy_version: int | None = Field(description="Version of the weights it serves; None until known.")
    in_flight: int = Field(description="Episodes running on it.")
    reloading: bool
    ready: bool = Field(
        default=True,
        description="Takes episodes: its version is known and, if it joined after the worker learned "
        "the policy, that policy is loaded.",
    )
    retired: bool = Field(
        default=False, description="Gone from DNS: its episodes finish, no new ones are sent to it."
    )


class EnvServerStatus(BaseModel):
    """One env server as a rollout worker sees it (part of :class:`WorkerStatus`)."""

    family: str
    url: str
    in_flight: int = Field(description="Episodes playing on it (an episode stays on one server).")
    retired: bool = Field(
        default=False, description="Gone from DNS: its episodes finish, no new ones are sent to it."
    )


class WorkerStatus(BaseModel):
    """What a rollout worker's ``GET /status`` answers, and what its heartbeat carries.

    Unknown fields are ignored (not forbidden, unlike the stream models): a dashboard of one
    version must still read the status of a worker of another.
    """

    worker_id: str
    concurrency: int
    in_flight: int = Field(description="Episodes being played now.")
    episodes_per_s: float = Field(description="Jobs completed per second over the rate window.")
    tokens_per_s: float = Field(description="Sampled tokens per second over the rate window.")
    policy_version: int | None = Field(description="Oldest version any engine serves; None until known.")
    target_policy_version: int | None = Field(description="The version stargym:<run>:policy names.")
    jobs_done: int = Field(description="Trajectories published without an error.")
    jobs_failed: int = Field(description="Trajectories published with 'error' set.")
    duplicates: int = Field(description="Jobs whose trajectory another run had already published.")
    reclaimed: int = Field(description="Jobs taken over from other (dead) consumers.")
    env_retries: int
    engine_backoffs: int = Field(description="Engine 429s waited out.")
    reloads: int
    redis_errors: int
    engines: list[EngineStatus]
    env_servers: list[EnvServerStatus] = Field(
        default_factory=list, description="Every env server of every family, with its episodes."
    )
    stopping: bool
    uptime_s: float


class WorkerHeartbeat(RolloutWireModel):
    """One field of :attr:`RunKeys.workers`: who a worker is, where it and its services are, how it is.

    ``envs`` and ``engines`` are the servers the worker plays against now (a configured name
    that resolves to several replicas is listed as one URL per address), which is how the
    dashboard discovers the env servers and engines; ``status`` is the worker's last
    :class:`WorkerStatus`, shown when the worker itself no longer answers.
    """

    worker_id: str = Field(min_length=1, description="The worker's consumer name in the 'rollout' group.")
    url: str | None = Field(description="The worker's own HTTP base URL (its /status); None if unknown.")
    envs: dict[str, list[str]] = Field(
        description="Env server URLs of each env family the worker plays (episodes are spread over them)."
    )
    engines: list[str] = Field(description="Engine base URLs the worker spreads episodes over.")
    heartbeat_s: float = Field(gt=0, description="How often the worker rewrites this field.")
    status: WorkerStatus
    updated_at: float = Field(description="Unix time this field was written.")

    @field_validator("envs", mode="before")
    @classmethod
    def _one_url_is_a_list_of_one(cls, value: Any) -> Any:
        """An entry written by a worker from before several servers per family (``{family: URL}``)."""
        if isinstance(value, dict):
            return {family: [urls] if isinstance(urls, str) else urls for family, urls in value.items()}
        return value

    @staticmethod
    def updated_at_of(raw: bytes | str) -> float:
        """An entry's ``updated_at`` read alone, so that entries this version cannot parse (another
        version's, or garbage) are still aged and pruned; 0.0 (long dead) when it has none."""
        try:
            value = orjson.loads(raw).get("updated_at")
        except (orjson.JSONDecodeError, AttributeError):
            return 0.0
        return float(value) if isinstance(value, int | float) else 0.0
