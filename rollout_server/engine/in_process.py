"""The CPU engine inside the rollout worker's process: completions without HTTP.

``stargym rollout --engine-model DIR`` loads the engine in the worker's own process and mounts
its HTTP app at ``/engine`` on the worker's port, so the engine protocol stays where every other
client expects it (the dashboard reads ``/engine/metrics``, admin calls and outside callers use
it as they use ``stargym engine serve``). The worker's own episodes reach the engine through
:class:`InProcessEngineClient`, an :class:`~services.engine_client.EngineClient` whose
completions call the route's own code (:func:`rollout_server.engine.app.run_completion`)
directly: the same checks, sampling and response, without the request's JSON, HTTP parsing,
loopback sockets and framework layers on both ends.

Why: on the 2-core CPU default those layers cost about as much CPU as the model. 128 concurrent
FrozenLake episodes of the tiny policy, one token a turn, took 0.76-0.85x the rollout CPU a turn
(worker, engine and env server together: 2.05 ms against 2.41, ``bench/rollout.py``) at
0.89-1.00x the episodes a second. The price is one process for both, under one GIL: it tops out
at one core, where the two processes used 1.35. The recipe trained at the same pace either way
(the engine thread sets the rollout's pace), so ``stargym up`` keeps the engine server by default.

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
