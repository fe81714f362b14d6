"""The CPU engine's HTTP API: vLLM's routes for generation, pausing and weight reload.

Built on ``services.http_app.create_app`` (health, metrics, JSON errors, auth, size limit). The
handlers only validate, tokenise and format: all model work happens on the engine thread, which
they reach through futures, so the event loop never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from transformers import PreTrainedModel

from rollout_server.engine.limits_doc import document_limits
from rollout_server.engine.sampling import SequenceSampling
from rollout_server.engine.scheduler import Engine, EngineFull, PauseMode, Sequence
from rollout_server.engine.settings import EngineSettings
from services.engine_protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CollectiveRpcRequest,
    CollectiveRpcResponse,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    IsPaused,
    ModelCard,
    ModelList,
    PauseStatus,
    UsageInfo,
    WeightInfo,
    WeightVersionUpdate,
    WeightVersionUpdated,
)
from services.errors import ApiError, bad_request, not_found, too_many
from services.http_app import create_app
from services.openapi import error_responses, refusals
from services.policy import PolicyLoadError

MIN_LOGPROB = -9999.0  # vLLM's floor, so -inf never reaches JSON


@dataclasses.dataclass
class EngineState:
    """What the handlers share: the engine, the tokenizer, and what /v1/models and /weight_info say."""

    engine: Engine
    model: PreTrainedModel
    tokenizer: Any
    settings: EngineSettings
    model_path: str
    model_name: str
    vocab_size: int
    weight_version: str = "default"
    _token_texts: dict[int, str] = dataclasses.field(default_factory=dict)

    def token_text(self, token: int) -> str:
        """One token decoded alone, as vLLM lists it in ``logprobs.tokens``; memoised (64 decodes a reply)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text


router = APIRouter()
CONTEXT_TOO_LONG = "the prompt and max_tokens together exceed the model's context (max_model_len)"
GENERATION_ERRORS = error_responses(
    404,
    429,
    descriptions={404: "No model of this name here (GET /v1/models).", 429: "max_num_seqs in flight."},
)


def _state(request: Request) -> EngineState:
    return request.app.state.engine_state


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    tags=["generation"],
    responses={
        **GENERATION_ERRORS,
        **refusals(
            400,
            {"context_too_long": CONTEXT_TOO_LONG, "empty_prompt": "the text of the prompt makes no token"},
        ),
    },
)
async def completions(body: CompletionRequest, request: Request) -> CompletionResponse:
    """Sample ``n`` continuations of the prompt; token ids and processed log-probs included."""
    state = _state(request)
    if body.model is not None and body.model != state.model_name:
        raise not_found("model", body.model)
    prompt = _prompt_ids(body, state)
    params = _sampling_params(body)
    _check_length(prompt, params.max_tokens, state.settings.max_model_len)
    if body.n > state.settings.max_num_seqs:
        raise bad_request(
            "too_many_samples", f"n={body.n} exceeds max_num_seqs={state.settings.max_num_seqs}"
        )
    sequences = await _generate(state, prompt, params, body.n, body.seed)
    return _response(body, state, prompt, sequences)


async def _generate(
    state: EngineState, prompt: list[int], params: SequenceSampling, n: int, seed: int | None
) -> list[Sequence]:
    """Run ``n`` samples of ``prompt`` on the engine thread (seed + i each) and wait for them."""
    sequences = [
        Sequence(prompt, dataclasses.replace(params, seed=None if seed is None else seed + index))
        for index in range(n)
    ]
    try:
        state.engine.submit(sequences)
    except EngineFull as exc:
        raise too_many("engine_full", str(exc)) from None
    try:
        await asyncio.gather(*(asyncio.wrap_future(sequence.done) for sequence in sequences))
    except asyncio.CancelledError:
        state.engine.abort(sequences)
        raise
    return sequences


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    tags=["generation"],
    responses={
        **GENERATION_ERRORS,
        **refusals(
            400,
            {
                "context_too_long": CONTEXT_TOO_LONG,
                "chat_template": "the model's chat template refuses these messages (their roles, order)",
            },
        ),
    },
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse:
    """OpenAI's chat route: the messages under the model's chat template, sampled like completions.

    Text in, text out (``choices[i].message.content``); what the OpenAI-compatible evaluation
    engine (``rollout_server.openai_chat``) and any OpenAI client speak. Training never uses it:
    the worker sends token ids to ``/v1/completions``.
    """
    state = _state(request)
    if body.model is not None and body.model != state.model_name:
        raise not_found("model", body.model)
    if body.n > state.settings.max_num_seqs:
        raise bad_request(
            "too_many_samples", f"n={body.n} exceeds max_num_seqs={state.settings.max_num_seqs}"
        )
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    try:
        text = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # no template, or a template that refuses these roles (jinja raises)
        raise bad_request(
            "chat_template", f"the model's chat template cannot render these messages: {exc}"
        ) from None
    prompt = list(state.tokenizer.encode(text, add_special_tokens=False))
    limits = [value for value in (body.max_tokens, body.max_completion_tokens) if value is not None]
    max_tokens = min(limits) if limits else max(1, state.settings.max_model_len - len(prompt))
    params = _sequence_sampling(body, max_tokens)
    _check_length(prompt, params.max_tokens, state.settings.max_model_len)
    sequences = await _generate(state, prompt, params, body.n, body.seed)
    choices = [
        ChatCompletionChoice(
            index=index,
            message=ChatResponseMessage(
                content=state.tokenizer.decode(sequence.output, skip_special_tokens=body.skip_special_tokens)
            ),
            finish_reason=sequence.finish_reason.value if sequence.finish_reason else None,
            stop_reason=sequence.stop_reason,
        )
        for index, sequence in enumerate(sequences)
    ]
    completion_tokens = sum(len(sequence.output) for sequence in sequences)
    usage = UsageInfo(
        prompt_tokens=len(prompt),
        completion_tokens=completion_tokens,
        total_tokens=len(prompt) + completion_tokens,
    )
    return ChatCompletionResponse(model=state.model_name, choices=choices, usage=usage)


def _prompt_ids(body: CompletionRequest, state: EngineState) -> list[int]:
    if isinstance(body.prompt, str):
        prompt = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        prompt = body.prompt
    if not prompt:
        raise bad_request("empty_prompt", "the prompt must hold at least one token")
    too_big = [token for token in prompt if token >= state.vocab_size]
    if too_big:
        raise bad_request("bad_token", f"token id {too_big[0]} is out of the vocabulary ({state.vocab_size})")
    return prompt


def _sampling_params(body: CompletionRequest) -> SequenceSampling:
    if body.logprobs not in (None, 0):
        raise bad_request("unsupported", "logprobs must be 0 (the sampled token's log-prob) or omitted")
    return _sequence_sampling(body, 16 if body.max_tokens is None else body.max_tokens)


def _sequence_sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SequenceSampling:
    """A request's sampling fields, unset ones at vLLM's defaults (T=1, top-p 1, no top-k)."""
    return SequenceSampling(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        max_tokens=max_tokens,
        seed=body.seed,
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
    )


def _check_length(prompt: list[int], max_tokens: int, max_model_len: int) -> None:
    if len(prompt) + max_tokens > max_model_len:
        raise bad_request(
            "context_too_long",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the completion).",
        )


def _response(
    body: CompletionRequest, state: EngineState, prompt: list[int], sequences: list[Sequence]
) -> CompletionResponse:
    tokenizer = state.tokenizer
    choices = []
    for index, sequence in enumerate(sequences):
        logprobs = None
        if body.logprobs is not None:
            tokens = [state.token_text(token) for token in sequence.output]
            values = [max(value, MIN_LOGPROB) for value in sequence.logprobs]
            offsets = [0]
            for token in tokens[:-1]:
                offsets.append(offsets[-1] + len(token))
            logprobs = CompletionLogProbs(
                text_offset=offsets,
                token_logprobs=values,
                tokens=tokens,
                top_logprobs=[{token: value} for token, value in zip(tokens, values, strict=True)],
            )
        choices.append(
            CompletionChoice(
                index=index,
                text=tokenizer.decode(sequence.output, skip_special_tokens=body.skip_special_tokens),
                logprobs=logprobs,
                finish_reason=sequence.finish_reason.value if sequence.finish_reason else None,
                stop_reason=sequence.stop_reason,
                token_ids=list(sequence.output) if body.return_token_ids else None,
                prompt_token_ids=list(prompt) if body.return_token_ids else None,
            )
        )
    completion_tokens = sum(len(sequence.output) for sequence in sequences)
    usage = UsageInfo(
        prompt_tokens=len(prompt),
        completion_tokens=completion_tokens,
        total_tokens=len(prompt) + completion_tokens,
    )
    return CompletionResponse(model=state.model_name, choices=choices, usage=usage)


@router.get("/v1/models", response_model=ModelList, tags=["generation"])
async def models(request: Request) -> ModelList:
    state = _state(request)
    card = ModelCard(id=state.model_name, root=state.model_path, max_model_len=state.settings.max_model_len)
    return ModelList(data=[card])


@router.post("/pause", response_model=PauseStatus, tags=["admin"])
async def pause(request: Request, mode: Annotated[PauseMode, Query()] = PauseMode.ABORT) -> PauseStatus:
    """Hold new requests; ``wait`` returns once in-flight ones finished, ``keep`` freezes them."""
    await asyncio.wrap_future(_state(request).engine.pause(mode))
    return PauseStatus(status="paused")


@router.post("/resume", response_model=PauseStatus, tags=["admin"])
async def resume(request: Request) -> PauseStatus:
    _state(request).engine.resume()
    return PauseStatus(status="resumed")


@router.get("/is_paused", response_model=IsPaused, tags=["admin"])
async def is_paused(request: Request) -> IsPaused:
    return IsPaused(is_paused=_state(request).engine.paused)


@router.post(
    "/collective_rpc",
    response_model=CollectiveRpcResponse,
    tags=["admin"],
    responses={
        **error_responses(403, descriptions={403: "weights_path is outside STARGYM_WEIGHTS_ROOTS."}),
        **refusals(
            400,
            {
                "bad_weights_path": "weights_path is not a directory",
                "bad_checkpoint": "the directory holds no checkpoint of this model",
            },
        ),
    },
)
async def collective_rpc(body: CollectiveRpcRequest, request: Request) -> CollectiveRpcResponse:
    """``reload_weights``: copy the safetensors of ``kwargs.weights_path`` into the serving model.

    It runs on the engine thread between two forward passes, so no request is dropped; requests
    in flight continue on the new weights (pause first, as vLLM's clients do, for a clean cut).
    Cached prompt prefixes are dropped with the old weights.
    Without ``weights_path`` the model directory the server started with is read again. A path
    outside :meth:`EngineSettings.allowed_weights_roots` is refused (403): whoever can reach the
    admin routes must not make the engine read any file its user can.
    """
    state = _state(request)
    if body.method != "reload_weights":
        raise bad_request(
            "unknown_method", f"unknown collective_rpc method {body.method!r}; known: reload_weights"
        )
    path = body.kwargs.get("weights_path") or state.model_path
    resolved = Path(path).resolve()
    roots = state.settings.allowed_weights_roots()
    if not any(resolved.is_relative_to(root) for root in roots):
        raise ApiError(
            403,
            "weights_path_not_allowed",
            f"weights_path {path!r} is outside the directories this engine loads from "
            f"({', '.join(map(str, roots))}; STARGYM_WEIGHTS_ROOTS sets them)",
        )
    if not resolved.is_dir():
        raise bad_request("bad_weights_path", f"weights_path {path!r} is not a directory")
    try:
        await asyncio.wrap_future(state.engine.load_weights(path))
    except PolicyLoadError as exc:
        raise bad_request("bad_checkpoint", str(exc)) from None
    return CollectiveRpcResponse(results=[None])


@router.post("/reset_prefix_cache", tags=["admin"], response_class=Response)
async def reset_prefix_cache(request: Request) -> Response:
    """Forget the KV kept for prompt reuse (a weight reload does this by itself too)."""
    await asyncio.wrap_future(_state(request).engine.reset_prefix_cache())
    return Response(status_code=200)


@router.post("/update_weight_version", response_model=WeightVersionUpdated, tags=["admin"])
async def update_weight_version(body: WeightVersionUpdate, request: Request) -> WeightVersionUpdated:
    _state(request).weight_version = body.new_version
    return WeightVersionUpdated(new_version=body.new_version)


@router.get("/weight_info", response_model=WeightInfo, tags=["admin"])
async def weight_info(request: Request) -> WeightInfo:
    return WeightInfo(weight_version=_state(request).weight_version)


class EngineCollector:
    """Engine counters for /metrics, read from the engine's stats at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Any:
        stats = self.engine.stats
        yield GaugeMetricFamily(
            "engine_sequences_in_flight", "Admitted sequences", value=self.engine.in_flight
        )
        counters = {
            "engine_generated_tokens": ("Tokens sampled", stats.generated_tokens),
            "engine_prompt_tokens": ("Prompt tokens of admitted requests", stats.prompt_tokens),
            "engine_reused_prompt_tokens": (
                "Prompt tokens whose KV came from the prefix cache",
                stats.reused_prompt_tokens,
            ),
            "engine_decode_steps": ("Batched decode forward passes", stats.steps),
            "engine_prefill_passes": ("Batched prefill forward passes", stats.prefill_passes),
            "engine_busy_seconds": ("Seconds the engine thread spent computing", stats.busy_seconds),
            "engine_finished_sequences": ("Sequences finished", stats.finished),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)


def build_app(engine: Engine, model: PreTrainedModel, tokenizer: Any, settings: EngineSettings) -> FastAPI:
    """The engine server; the engine thread starts and stops with the app."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = create_app(
        "engine",
        settings,
        description="CPU inference engine speaking vLLM's protocol: token-in generation, pause, weight reload.",
        lifespan=lifespan,
    )
    app.state.engine_state = EngineState(
        engine=engine,
        model=model,
        tokenizer=tokenizer,
        settings=settings,
        model_path=str(Path(settings.model).resolve()),
        model_name=settings.served_model_name or settings.model,
        vocab_size=model.get_input_embeddings().num_embeddings,
    )
    app.state.metrics_registry.register(EngineCollector(engine))
    app.include_router(router)
    document_limits(app, settings, app.state.engine_state.vocab_size)
    return app
