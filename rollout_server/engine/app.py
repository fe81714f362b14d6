"""The CPU engine's HTTP API: vLLM's routes for generation, pausing and weight reload.

Built on ``services.http_app.create_app`` (health, metrics, JSON errors, auth, size limit). The
handlers only validate, tokenise and format: all model work happens on the engine thread, which
they reach through futures, so the event loop never blocks on a forward pass.

The generation routes take what the official ``openai`` client sends and answer as vLLM's
OpenAI server does: stop strings (text cut before them, every token id kept), presence,
frequency and repetition penalties and ``logit_bias`` (on the engine thread, for the rows that
ask), log-probs with up to 20 most likely tokens per position, ``stream: true`` as server-sent
events (:mod:`rollout_server.engine.streaming`), ``user`` (ignored), and on the chat route
``tools``/``tool_choice`` (rendered by the chat template, replies parsed for Hermes/Qwen tool calls,
:mod:`rollout_server.engine.chat`). What it cannot do it refuses with a 400 that says so:
``response_format`` JSON needs guided decoding, which only vLLM has. Where vLLM could force a tool
call (``tool_choice: "required"`` or a named function), this engine treats it as ``"auto"``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from transformers import PreTrainedModel

from rollout_server.engine.chat import (
    ParsedReply,
    parse_tool_calls,
    parses_tool_calls,
    refuse_unsupported,
    template_messages,
    template_tools,
)
from rollout_server.engine.detokenize import IncrementalText
from rollout_server.engine.limits_doc import document_limits
from rollout_server.engine.openai_format import chat_logprobs, completion_logprobs, final_text, finish_reason
from rollout_server.engine.sampling import SequenceSampling
from rollout_server.engine.scheduler import Engine, EngineFull, PauseMode
from rollout_server.engine.scheduler import Sequence as EngineSequence
from rollout_server.engine.settings import EngineSettings
from rollout_server.engine.streaming import (
    EngineStream,
    ProgressQueue,
    StreamContext,
    chat_events,
    completion_events,
    new_stream_id,
)
from services.engine_protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CollectiveRpcRequest,
    CollectiveRpcResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
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
from services.fast_route import FastPathRoute
from services.http_app import OrjsonResponse, create_app
from services.openapi import error_responses, extend_openapi, refusals
from services.policy import PolicyLoadError


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

    @classmethod
    def create(
        cls, engine: Engine, model: PreTrainedModel, tokenizer: Any, settings: EngineSettings
    ) -> EngineState:
        return cls(
            engine=engine,
            model=model,
            tokenizer=tokenizer,
            settings=settings,
            model_path=str(Path(settings.model).resolve()),
            model_name=settings.served_model_name or settings.model,
            vocab_size=model.get_input_embeddings().num_embeddings,
        )

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
SAMPLING_REFUSALS = {
    "context_too_long": CONTEXT_TOO_LONG,
    "bad_logit_bias": "a logit_bias key is not a token id of this model's vocabulary",
    "unsupported_response_format": "response_format json_object or json_schema: the CPU engine cannot "
    "constrain decoding to JSON (vLLM can)",
    "stream_options_without_stream": "stream_options is set but stream is not true",
}


def _event_stream(chunk: str) -> dict[int | str, Any]:
    """The 200's second form, ``text/event-stream`` (``stream: true``), each event documented:
    ``data`` is ``[DONE]`` or a chunk (or, if the engine failed mid-stream, an error) as JSON."""
    payload = {
        "anyOf": [
            {"$ref": f"#/components/schemas/{chunk}"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]
    }
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": payload},
    }
    return {
        200: {
            "description": "The response; with stream: true, server-sent events (text/event-stream), "
            f"each 'data: <{chunk} JSON>', the last 'data: [DONE]'.",
            "content": {
                "text/event-stream": {
                    "schema": {"type": "object", "properties": {"data": data}, "required": ["data"]}
                }
            },
        }
    }


def _state(request: Request) -> EngineState:
    return request.app.state.engine_state


class CompletionRoute(FastPathRoute):
    """``POST /v1/completions``: every turn of every rollout. A body that validates as it is and
    asks for no stream is answered by :func:`run_completion` without FastAPI's dependency solving
    and response validation (:mod:`services.fast_route`); the rest goes to :func:`completions`."""

    async def fast(self, request: Request, payload: Any) -> Response | None:
        if type(payload) is not dict:
            return None
        try:
            body = CompletionRequest.model_validate(payload)
        except ValidationError:
            return None
        if body.stream:
            return None
        response = await run_completion(body, _state(request))
        return OrjsonResponse(response.model_dump(mode="json"))


async def completions(body: CompletionRequest, request: Request) -> Any:
    """Sample ``n`` continuations of the prompt; token ids and processed log-probs included.

    Stop strings, penalties, ``logit_bias``, ``logprobs`` up to 20 and streaming behave as in
    vLLM's server (see the fields); ``response_format`` JSON is a 400, as the engine cannot
    constrain decoding.
    """
    state = _state(request)
    if not body.stream:
        return await run_completion(body, state)
    prompt, sequences, decode = _completion_sequences(body, state)
    context = _stream_context(body, state, prompt, sequences, decode, "cmpl")
    context.logprobs = body.logprobs is not None
    context.return_token_ids = bool(body.return_token_ids)
    return _stream(state, sequences, lambda progress: completion_events(context, progress))


router.add_api_route(
    "/v1/completions",
    completions,
    methods=["POST"],
    route_class_override=CompletionRoute,
    response_model=CompletionResponse,
    tags=["generation"],
    responses={
        **_event_stream("CompletionStreamResponse"),
        **GENERATION_ERRORS,
        **refusals(400, {**SAMPLING_REFUSALS, "empty_prompt": "the text of the prompt makes no token"}),
    },
)


async def run_completion(body: CompletionRequest, state: EngineState) -> CompletionResponse:
    """A completion that is not streamed, from request to response: the route's work, which an
    engine in the worker's own process (:mod:`rollout_server.engine.in_process`) calls directly.
    Refusals raise :class:`~services.errors.ApiError` (400, 404, 429), as the route answers them."""
    prompt, sequences, decode = _completion_sequences(body, state)
    await _generate(state, sequences)
    choices = [
        CompletionChoice(
            index=index,
            text=final_text(sequence, decode),
            logprobs=None
            if body.logprobs is None
            else completion_logprobs(sequence, 0, len(sequence.output), state.token_text),
            finish_reason=finish_reason(sequence),
            stop_reason=sequence.stop_reason,
            token_ids=list(sequence.output) if body.return_token_ids else None,
            prompt_token_ids=list(prompt) if body.return_token_ids else None,
        )
        for index, sequence in enumerate(sequences)
    ]
    return CompletionResponse(model=state.model_name, choices=choices, usage=_usage(prompt, sequences))


def _completion_sequences(
    body: CompletionRequest, state: EngineState
) -> tuple[list[int], list[EngineSequence], Callable[[Sequence[int]], str]]:
    """The checked prompt, the ``n`` sequences to run and the decoder of a completion request."""
    _check_request(body, state)
    prompt = _prompt_ids(body, state)
    params = _sequence_sampling(body, 16 if body.max_tokens is None else body.max_tokens, state)
    params = dataclasses.replace(params, top_logprobs=body.logprobs or 0)
    _check_length(prompt, params.max_tokens, state.settings.max_model_len)
    decode = _decoder(state, body.skip_special_tokens)
    return prompt, _sequences(prompt, params, body, decode), decode


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    tags=["generation"],
    responses={
        **_event_stream("ChatCompletionChunk"),
        **GENERATION_ERRORS,
        **refusals(
            400,
            {
                **SAMPLING_REFUSALS,
                "chat_template": "the model's chat template refuses these messages (their roles, order)",
                "top_logprobs_without_logprobs": "top_logprobs is set but logprobs is not true",
                "bad_tool_call_arguments": "an assistant tool call's function.arguments is not a JSON "
                "object as a string",
                "tool_choice_without_tools": "tool_choice other than 'none' without tools",
                "unknown_tool": "tool_choice names a function that is not among tools",
            },
        ),
    },
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI's chat route: the messages under the model's chat template, sampled like completions.

    Text in, text out (``choices[i].message.content``); what the OpenAI-compatible evaluation
    engine (``rollout_server.openai_chat``) and any OpenAI client speak. Training never uses it:
    the worker sends token ids to ``/v1/completions``.

    ``tools`` are rendered by the chat template (``apply_chat_template(..., tools=...)``), and
    unless ``tool_choice`` is ``"none"`` the reply is parsed for Hermes/Qwen ``<tool_call>``
    blocks into ``message.tool_calls`` (finish_reason ``"tool_calls"``); a block that is not JSON
    leaves the reply as plain content. ``tool_choice: "required"`` or a named function cannot be
    enforced without guided decoding, which this engine lacks: they are treated like ``"auto"``.
    The messages may hold an agent's earlier ``tool_calls`` and ``tool`` results, and the
    ``developer`` role (as system). ``response_format`` JSON is a 400.
    """
    state = _state(request)
    _check_request(body, state)
    tools = template_tools(body)
    messages = template_messages(body)
    try:
        text = state.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # no template, or a template that refuses these roles (jinja raises)
        raise bad_request(
            "chat_template", f"the model's chat template cannot render these messages: {exc}"
        ) from None
    prompt = list(state.tokenizer.encode(text, add_special_tokens=False))
    limits = [value for value in (body.max_tokens, body.max_completion_tokens) if value is not None]
    max_tokens = min(limits) if limits else max(1, state.settings.max_model_len - len(prompt))
    params = _sequence_sampling(body, max_tokens, state)
    if body.logprobs:
        params = dataclasses.replace(params, top_logprobs=body.top_logprobs or 0)
    _check_length(prompt, params.max_tokens, state.settings.max_model_len)
    decode = _decoder(state, body.skip_special_tokens)
    sequences = _sequences(prompt, params, body, decode)
    tool_calls = parses_tool_calls(body)
    parallel = body.parallel_tool_calls is not False
    if body.stream:
        context = _stream_context(body, state, prompt, sequences, decode, "chatcmpl")
        context.logprobs = bool(body.logprobs)
        context.tool_calls, context.parallel_tool_calls = tool_calls, parallel
        return _stream(state, sequences, lambda progress: chat_events(context, progress))
    await _generate(state, sequences)
    choices = []
    for index, sequence in enumerate(sequences):
        reply = ParsedReply(content=final_text(sequence, decode))
        if tool_calls:
            reply = parse_tool_calls(reply.content or "", parallel)
        choices.append(
            ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(content=reply.content, tool_calls=reply.tool_calls),
                logprobs=chat_logprobs(sequence, 0, len(sequence.output), state.token_text)
                if body.logprobs
                else None,
                finish_reason="tool_calls" if reply.tool_calls else finish_reason(sequence),
                stop_reason=None if reply.tool_calls else sequence.stop_reason,
            )
        )
    return ChatCompletionResponse(model=state.model_name, choices=choices, usage=_usage(prompt, sequences))


def _check_request(body: CompletionRequest | ChatCompletionRequest, state: EngineState) -> None:
    """The refusals both routes share: the model's name, ``n``, and what the engine cannot do."""
    if body.model is not None and body.model != state.model_name:
        raise not_found("model", body.model)
    if body.n > state.settings.max_num_seqs:
        raise bad_request(
            "too_many_samples", f"n={body.n} exceeds max_num_seqs={state.settings.max_num_seqs}"
        )
    refuse_unsupported(body)


def _sequences(
    prompt: list[int],
    params: SequenceSampling,
    body: CompletionRequest | ChatCompletionRequest,
    decode: Callable[[Sequence[int]], str],
) -> list[EngineSequence]:
    """``n`` samples of ``prompt`` (seed + i each); a sequence that stops on text or is streamed
    gets its text decoded as it goes, on the engine thread."""
    needs_text = bool(params.stop) or bool(body.stream)
    return [
        EngineSequence(
            prompt,
            dataclasses.replace(params, seed=None if body.seed is None else body.seed + index),
            text=IncrementalText(decode, params.stop) if needs_text else None,
        )
        for index in range(body.n)
    ]


def _submit(state: EngineState, sequences: list[EngineSequence]) -> None:
    try:
        state.engine.submit(sequences)
    except EngineFull as exc:
        raise too_many("engine_full", str(exc)) from None


async def _generate(state: EngineState, sequences: list[EngineSequence]) -> None:
    """Run ``sequences`` on the engine thread and wait for them; abort them if the request is cancelled."""
    _submit(state, sequences)
    try:
        await asyncio.gather(*(asyncio.wrap_future(sequence.done) for sequence in sequences))
    except asyncio.CancelledError:
        state.engine.abort(sequences)
        raise


def _stream(
    state: EngineState,
    sequences: list[EngineSequence],
    events: Callable[[ProgressQueue], AsyncIterator[str]],
) -> EngineStream:
    """Submit ``sequences`` (a full engine is still a plain 429) and stream their events."""
    progress = ProgressQueue(sequences)
    _submit(state, sequences)
    return EngineStream(events(progress), state.engine, sequences)


def _stream_context(
    body: CompletionRequest | ChatCompletionRequest,
    state: EngineState,
    prompt: list[int],
    sequences: list[EngineSequence],
    decode: Callable[[Sequence[int]], str],
    prefix: str,
) -> StreamContext:
    return StreamContext(
        id=new_stream_id(prefix),
        model=state.model_name,
        prompt=prompt,
        sequences=sequences,
        token_text=state.token_text,
        decode=decode,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        stops=sequences[0].params.stop,
    )


def _decoder(state: EngineState, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    return functools.partial(state.tokenizer.decode, skip_special_tokens=skip_special_tokens)


def _usage(prompt: list[int], sequences: list[EngineSequence]) -> UsageInfo:
    completion_tokens = sum(len(sequence.output) for sequence in sequences)
    return UsageInfo(
        prompt_tokens=len(prompt),
        completion_tokens=completion_tokens,
        total_tokens=len(prompt) + completion_tokens,
    )


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


def _sequence_sampling(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int, state: EngineState
) -> SequenceSampling:
    """A request's sampling fields, unset ones at vLLM's defaults (T=1, top-p 1, no top-k, no penalties)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SequenceSampling(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        max_tokens=max_tokens,
        seed=body.seed,
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        stop=stop,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias, state.vocab_size),
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise bad_request(
                "bad_logit_bias",
                f"logit_bias key {key[:40]!r} is not a token id of this model (0 to {vocab_size - 1})",
            )
        pairs.append((token, value))
    return tuple(pairs)


def _check_length(prompt: list[int], max_tokens: int, max_model_len: int) -> None:
    if len(prompt) + max_tokens > max_model_len:
        raise bad_request(
            "context_too_long",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the completion).",
        )


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


def build_app(state: EngineState) -> FastAPI:
    """The engine server; the engine thread starts and stops with the app.

    Mounted in a rollout worker's app (``stargym rollout --engine-model``) this lifespan does not
    run (Starlette runs only the outer app's): the worker starts and stops the thread itself.
    """
    engine, settings = state.engine, state.settings

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
    app.state.engine_state = state
    app.state.metrics_registry.register(EngineCollector(engine))
    app.include_router(router)
    document_limits(app, settings, state.vocab_size)
    extend_openapi(app, _add_stream_chunks)
    return app


def _add_stream_chunks(document: dict[str, Any]) -> None:
    """The chunk models the event streams refer to: no route returns them as a body, so FastAPI
    leaves them out of the document's components."""
    schemas = document["components"]["schemas"]
    for model in (CompletionStreamResponse, ChatCompletionChunk):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas.setdefault(model.__name__, schema)
