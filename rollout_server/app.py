"""The rollout worker's HTTP API on :8200: /health, /metrics, /status, and the agent sessions'
OpenAI-compatible routes under /sessions/{id} (:mod:`rollout_server.proxy`), and with
``--engine-model`` the engine protocol of the engine in its process under /engine.

/health is a 503 naming Redis while Redis does not answer, or naming the engines while every
engine the worker had is lost (it stopped answering); the worker waits for them to come back, and
is healthy again once they do.

The worker runs inside the app's lifespan: it starts with the server and, when uvicorn shuts down
(SIGTERM, SIGINT), stops taking jobs and finishes or abandons its in-flight episodes before the
process exits (see :meth:`rollout_server.worker.RolloutWorker.shutdown`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from rollout_server import proxy
from rollout_server.settings import ENGINE_MOUNT, WorkerSettings
from rollout_server.worker import RolloutWorker, WorkerStatus
from services.http_app import create_app

if TYPE_CHECKING:
    from rollout_server.engine.app import EngineState

logger = logging.getLogger(__name__)


def build_app(
    settings: WorkerSettings, tokenizer: Any, *, engine: EngineState | None = None, **worker_options: Any
) -> FastAPI:
    """The app; ``worker_options`` go to :class:`RolloutWorker` (e.g. a ``run_episode`` for tests).

    ``engine``: the engine of ``settings.engine_model``, loaded in this process. Its app is mounted
    at :data:`~rollout_server.settings.ENGINE_MOUNT`, and its thread runs from before the worker
    starts until after it has stopped (a mounted app's own lifespan does not run).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            engine.engine.start()
        worker = RolloutWorker(
            settings, tokenizer, registry=app.state.metrics_registry, engine=engine, **worker_options
        )
        app.state.worker = worker
        task = asyncio.create_task(worker.run(), name="rollout-worker")
        task.add_done_callback(_report_exit)
        try:
            yield
        finally:
            await worker.shutdown()
            await task
            if engine is not None:
                engine.engine.stop()

    def unhealthy(app: FastAPI) -> str | None:
        worker: RolloutWorker | None = getattr(app.state, "worker", None)
        return worker.unhealthy() if worker is not None else None

    app = create_app(
        "rollout",
        settings,
        description="Rollout worker: jobs in, trajectories out.",
        lifespan=lifespan,
        unhealthy=unhealthy,
        mounted=[ENGINE_MOUNT] if engine is not None else [],
    )

    @app.get("/status", response_model=WorkerStatus, tags=["rollout"])
    async def status(request: Request) -> WorkerStatus:
        """In-flight episodes, throughput, the policy version served, and job counts."""
        return request.app.state.worker.status()

    app.include_router(proxy.router)
    if engine is not None:
        from rollout_server.engine.app import build_app as build_engine_app

        app.mount(ENGINE_MOUNT, build_engine_app(engine))
    return app


def _report_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the rollout worker stopped", exc_info=task.exception())
