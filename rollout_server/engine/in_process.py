"""The CPU engine inside the rollout worker's process: completions without HTTP.

``stargym rollout --engine-model DIR`` loads the engine in the worker's own process and mounts
its HTTP app at ``/engine`` on the worker's port, so the engine protocol stays where every other
client expects it (the dashboard reads ``/engine/metrics``, admin calls and outside callers use
it as they use ``stargym engine serve``). The worker's own episodes reach the engine through
:class:`InProcessEngineClient`, an :class:`~services.engine_client.EngineClient` whose
completions call the route's own code (:func:`rollout_server.engine.app.run_completion`)
directly: the same checks, sampling and response, without the request's JSON, HTTP parsing,
loopback sockets and framework layers on both ends.

Why: on the 2-core CPU default those layers cost as much CPU as the model. 128 concurrent
FrozenLake episodes of the tiny policy took 2.47-2.64 ms of CPU a turn over HTTP (worker, engine
and env server together) and 1.82-2.04 ms with the engine in the worker's process, at the same
600-660 turns/s; every CPU millisecond the rollout side saves goes to the trainer beside it.
The price is one process for both, under one GIL: the engine thread and the episodes share a
core's worth of Python, which is what 2 cores leave the rollout side anyway.

Admin calls (``weight_info``, ``/v1/models``, ``load_policy``'s pause, reload and resume) are
rare and keep going over HTTP, to the mounted app: one implementation of each, with its checks
(the weights roots a reload may read).
"""

from __future__ import annotations

from typing import Any

from rollout_server.engine.app import EngineState, run_completion
from services.engine_client import Completion, EngineClient, completion_of, typed_engine_error
from services.engine_protocol import CompletionRequest
from services.errors import ApiError


class InProcessEngineClient(EngineClient):
    """An :class:`EngineClient` of the engine in this process, reached at ``url`` for admin calls.

    A refusal raises what the HTTP client raises for the same answer (a 400 for a prompt past
    the context is :class:`~services.engine_client.EngineContextLengthError`). A full engine
    (429) raises :class:`~services.engine_client.EngineBusyError` at once rather than backing off:
    the worker sizes the engine for its concurrency, so only agent sessions sending several
    requests at a time can fill it, and the worker reruns such an episode.
    """

    def __init__(self, state: EngineState, url: str, **options: Any) -> None:
        super().__init__([url], **options)
        self.state = state

    async def _sample(self, request: CompletionRequest, target: str) -> Completion:
        try:
            response = await run_completion(request, self.state)
        except ApiError as exc:
            raise typed_engine_error(exc.status, exc.code, exc.message, "in-process", target) from None
        return completion_of(response, target)
