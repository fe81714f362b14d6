"""Pydantic models of the env HTTP API: the one definition both the env server and its clients use.

Field names follow docs/architecture.md ("Env HTTP API"); the AgentGym-compatible routes have their own
models at the bottom, with AgentGym's exact field names.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.json_types import WHOLE_FLOATS, JsonInt

JsonDict = dict[str, Any]
Seed = Annotated[int, Field(ge=0, lt=2**63), WHOLE_FLOATS]
INSTANCE_ID_PATTERN = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
"""Instance ids are UUIDs in canonical form, ``str(uuid.uuid4())``."""


class WireModel(BaseModel):
    """Strict about unknown fields, so a misspelt key is a 422 rather than silently ignored."""

    model_config = ConfigDict(extra="forbid")


class RequestModel(WireModel):
    """A request body: its JSON types exactly as its schema states them.

    pydantic's lax mode would take ``true`` or ``"5"`` for an integer, a schema-invalid body
    answered as if valid; strict mode refuses them, as a client generated from the document would
    never send them (integers take :data:`services.json_types.WHOLE_FLOATS`, so ``5.0`` stays valid).
    """

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorBody(WireModel):
    code: str
    message: str


class ErrorResponse(WireModel):
    error: ErrorBody


class EnvSpec(WireModel):
    """What ``GET /envs`` says about one environment."""

    id: str = Field(description="'family/name', e.g. 'game/sokoban'.")
    name: str
    family: str
    instruction: str
    action_format: str
    default_max_turns: int
    reward_range: tuple[float, float]
    options_schema: JsonDict = Field(description="JSON schema of the options accepted at create/reset.")


class EnvList(WireModel):
    envs: list[EnvSpec]


class CreateInstance(RequestModel):
    env: str = Field(description="An id from GET /envs.", examples=["game/frozenlake"])
    seed: Seed | None = Field(default=None, description="Same seed, same initial state. Random when omitted.")
    options: JsonDict | None = None


class InstanceCreated(WireModel):
    instance_id: str
    observation: str
    info: JsonDict


class StepRequest(RequestModel):
    action: str


class StepResult(WireModel):
    observation: str
    reward: float
    done: bool
    info: JsonDict


class ResetRequest(RequestModel):
    seed: Seed | None = None
    options: JsonDict | None = Field(default=None, description="Omitted: keep the instance's options.")


class Observed(WireModel):
    """An observation with its info: what create and reset return besides the id."""

    observation: str
    info: JsonDict


class InstanceState(WireModel):
    instance_id: str
    env: str
    seed: int
    options: JsonDict
    observation: str
    done: bool
    turns: int
    total_reward: float
    created_at: float
    last_used_at: float


class InstanceList(WireModel):
    instances: list[InstanceState]
    count: int
    limit: int


class BatchStepItem(RequestModel):
    instance_id: str
    action: str


class BatchStepRequest(RequestModel):
    steps: list[BatchStepItem] = Field(max_length=4096)


class BatchStepOutcome(WireModel):
    """One entry per requested step, in order: either ``result`` or ``error`` is set."""

    instance_id: str
    result: StepResult | None = None
    error: ErrorBody | None = None


class BatchStepResponse(WireModel):
    results: list[BatchStepOutcome]


class Health(WireModel):
    status: str = "ok"
    service: str
    version: str
    launch_id: str | None = None  # the launcher's STARGYM_LAUNCH_ID, where one started it


# AgentGym-compatible routes: AgentGym's own field names, so its unmodified clients work.
# AgentGym's servers ignore fields they do not know (pydantic's default), and so do these.
# Ids are our UUID strings where AgentGym has integers: its clients only echo the id they got.


class AgentGymRequest(BaseModel):
    """An AgentGym request body: unknown fields ignored, as AgentGym's servers do, but the types of
    the known ones exact (strict), as the schema states them."""

    model_config = ConfigDict(strict=True)


class AgentGymCreate(AgentGymRequest):
    """What AgentGym's TextCraft client sends to /create; its other clients send no body at all.

    A custom task (``commands``, ``goal``) is not supported: both are null in the schema, so a
    client sees it, and a value names the alternative.
    """

    minecraft_dir: str | None = Field(default=None, description="Ignored: our envs ship their own data.")
    commands: None = Field(default=None, description="A custom task's recipes: not supported.")
    goal: None = Field(default=None, description="A custom task's goal: not supported.")

    @model_validator(mode="before")
    @classmethod
    def no_custom_task(cls, data: Any) -> Any:
        if isinstance(data, dict) and (data.get("commands") is not None or data.get("goal") is not None):
            raise ValueError(
                "custom tasks (commands, goal) are not supported; pick a task with /reset data_idx"
            )
        return data


class AgentGymCreated(BaseModel):
    """TextCraft's /create answer (the others give only ``id``, a subset)."""

    id: str
    observation: str
    reward: float = 0.0
    done: bool = False


class AgentGymStep(AgentGymRequest):
    id: str
    action: str


class AgentGymReset(AgentGymRequest):
    id: str
    data_idx: Seed = Field(default=0, description="The task: our envs use it as the seed.")


class AgentGymClose(AgentGymRequest):
    id: str


class AgentGymStepResult(BaseModel):
    """TextCraft's step answer plus BabyAI's and SciWorld's ``score`` (the episode's reward so far)."""

    observation: str
    reward: float
    score: float
    done: bool


class AgentGymResetResult(BaseModel):
    """The union of what AgentGym's TextCraft, BabyAI and SciWorld clients read from /reset.

    SciWorld's client shows ``task_description + "\n" + observation``; our observations already
    state the task, so ``task_description`` is empty.
    """

    id: str
    observation: str
    reward: float = 0.0
    score: float = 0.0
    done: bool = False
    task_description: str = ""


# -- AgentGym's env_idx dialect (its SearchQA server and client) ---------------------------------


class AgentGymIndexedCreate(AgentGymRequest):
    """SearchQA's /create body: ``{"id": 0}``, a number it never uses again."""

    id: JsonInt = 0


class AgentGymIndexedStep(AgentGymRequest):
    env_idx: str
    action: str


class AgentGymIndexedReset(AgentGymRequest):
    env_idx: str
    id: Seed = Field(default=0, description="The task (AgentGym's data_idx).")


class AgentGymIndexedClose(AgentGymRequest):
    env_idx: str


class AgentGymIndexedStepResult(BaseModel):
    """SearchQA's step answer; its client reads the first three."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] | None = None


# --- AgentGym's WebShop dialect -------------------------------------------------------------


class AgentGymShopReset(AgentGymRequest):
    """WebShop's /reset body: the session is the goal's number (none: the instance's own goal)."""

    env_idx: str
    session_id: Seed | None = None


class AgentGymShopStepResult(BaseModel):
    """WebShop's step answer: the page as text in ``state``; ``info`` is always null there."""

    state: str
    reward: float
    done: bool
    info: None = None


class AgentGymShopActions(BaseModel):
    has_search_bar: bool
    clickables: list[str] = Field(description="The page's clickables, lower case (WebShop's).")


class AgentGymShopState(BaseModel):
    url: str
    html: str
    instruction_text: str


class AgentGymShopClosed(BaseModel):
    closed: bool
