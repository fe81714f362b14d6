"""Builds the env server's FastAPI app for a set of env classes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI
from prometheus_client import Gauge

from env_server.agentgym import agentgym_router
from env_server.core import Env
from env_server.openenv import router as openenv_router
from env_server.options_schema import document_env_options
from env_server.pool import InstancePool
from env_server.routes import router
from env_server.sandbox import SandboxHost, sandboxed_ids
from env_server.step_fast_path import StepFastPath
from services.http_app import create_app
from services.settings import EnvServerSettings


def build_app(env_classes: dict[str, type[Env]], settings: EnvServerSettings) -> FastAPI:
    isolated = sandboxed_ids(env_classes, settings.isolate)
    sandbox = (
        SandboxHost({env_id: env_classes[env_id] for env_id in isolated}, settings.step_timeout_s)
        if isolated
        else None
    )
    pool = InstancePool(
        env_classes, max_instances=settings.max_instances, ttl_s=settings.instance_ttl_s, sandbox=sandbox
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=settings.worker_threads, thread_name_prefix="env")
        )
        if sandbox is not None:
            await sandbox.start()
        reaper = asyncio.create_task(pool.reap_forever(settings.reaper_interval_s))
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await pool.close_all()
            if sandbox is not None:
                await sandbox.stop()
            for env_class in env_classes.values():
                await asyncio.to_thread(env_class.shutdown)

    families = sorted({cls.family for cls in env_classes.values()})
    app = create_app(
        f"env server ({', '.join(families)})",
        settings,
        description="Create, step and close environment instances. AgentGym-compatible routes under "
        "/agentgym/, OpenEnv WebSocket sessions under /openenv/.",
        lifespan=lifespan,
        inner_middleware=[StepFastPath],
    )
    app.state.pool = pool
    document_env_options(app, env_classes)
    registry = app.state.metrics_registry
    Gauge("env_instances", "Live env instances", registry=registry).set_function(lambda: len(pool))
    Gauge("env_instance_limit", "Instance limit", registry=registry).set(settings.max_instances)
    Gauge("env_instances_reaped", "Instances closed for idleness", registry=registry).set_function(
        lambda: pool.reaped_total
    )
    app.include_router(router)
    app.include_router(openenv_router)
    for env_id, env_class in env_classes.items():
        app.include_router(agentgym_router(env_id, env_class), prefix=f"/agentgym/{env_class.name}")
        for env_router in env_class.routers():
            app.include_router(env_router)
    return app
