"""The rollout worker's HTTP API on :8200: /health, /metrics, /status, and the agent sessions'
OpenAI-compatible routes under /sessions/{id} (:mod:`rollout_server.proxy`).

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
from typing import Any

from fastapi import FastAPI, Request

from rollout_server import proxy
from rollout_server.settings import WorkerSettings
from rollout_server.worker import RolloutWorker, WorkerStatus
from services.http_app import create_app

logger = logging.getLogger(__name__)


def build_app(settings: WorkerSettings, tokenizer: Any, **worker_options: Any) -> FastAPI:
    """The app; ``worker_options`` go to :class:`RolloutWorker` (e.g. a ``run_episode`` for tests)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = RolloutWorker(settings, tokenizer, registry=app.state.metrics_registry, **worker_options)
        app.state.worker = worker
        task = asyncio.create_task(worker.run(), name="rollout-worker")
        task.add_done_callback(_report_exit)
        try:
            yield
        finally:
            await worker.shutdown()
            await task

    def unhealthy(app: FastAPI) -> str | None:
        worker: RolloutWorker | None = getattr(app.state, "worker", None)
        return worker.unhealthy() if worker is not None else None

    app = create_app(
        "rollout",
        settings,
        description="Rollout worker: jobs in, trajectories out.",
        lifespan=lifespan,
        unhealthy=unhealthy,
    )

    @app.get("/status", response_model=WorkerStatus, tags=["rollout"])
    async def status(request: Request) -> WorkerStatus:
        """In-flight episodes, throughput, the policy version served, and job counts."""
        return request.app.state.worker.status()

    app.include_router(proxy.router)
    return app


def _report_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the rollout worker stopped", exc_info=task.exception())
