"""The dashboard's routes: the page, its static files and the read-only JSON API it polls.

:func:`install_dashboard` adds them to an app made by :func:`services.http_app.create_app`, so
the dashboard has the services' JSON errors, size limit and token auth: the trainer adds them to
its own app (its run is the live one), ``stargym dashboard RUNS_DIR`` to an app of its own.

Handlers are plain ``def`` functions: FastAPI runs them in its thread pool, so parsing a run's
files never blocks the trainer's event loop (which issues jobs and reads trajectories). A lock
serialises them, since the readers keep incremental state.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from services.errors import ApiError, not_found
from services.http_app import OrjsonResponse
from services.openapi import error_responses, refusals
from trainer.dashboard.runs import DEFAULT_MAX_POINTS, RunsDirectory
from trainer.dashboard.samples import SampleFilter, summary
from trainer.dashboard.tokens import TokenTexts

STATIC_DIR = Path(__file__).parent / "static"
MAX_KEYS = 200
NO_RUN = error_responses(
    404, descriptions={404: "No run of this name in the runs directory (GET /api/runs)."}
)


def plotly_bundle() -> Path:
    """The Plotly bundle the PyPI ``plotly`` package ships: served locally, never from a CDN."""
    path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the 'plotly' package (make setup)")
    return path


def install_dashboard(
    app: FastAPI,
    runs: RunsDirectory,
    *,
    texts: TokenTexts,
    system: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    no_system_reason: str = "no Redis URL was given (stargym dashboard --redis-url URL)",
) -> None:
    """Add ``/``, ``/static/*`` and ``/api/*`` to ``app``.

    ``system``: returns the system snapshot (:mod:`trainer.dashboard.system`); None when this
    dashboard cannot see the services, and ``/api/system`` then says why (``no_system_reason``).
    """
    lock = threading.Lock()
    plotly = plotly_bundle()

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(plotly, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    @app.get("/api/runs", tags=["dashboard"])
    def list_runs() -> dict[str, Any]:
        """Every run of the runs directory, newest first."""
        with lock:
            return {"runs": runs.summaries(), "live_run": runs.live_run}

    @app.get("/api/runs/{run}/config", tags=["dashboard"], responses=NO_RUN)
    def run_config(run: str) -> dict[str, Any]:
        with lock:
            return {"run": run, "yaml": runs.reader(run).config_text()}

    @app.get(
        "/api/runs/{run}/metrics",
        tags=["dashboard"],
        responses={**NO_RUN, **refusals(400, {"too_many_keys": f"keys has more than {MAX_KEYS} patterns"})},
    )
    def run_metrics(
        run: str,
        keys: Annotated[str, Query(description="Comma-separated keys; '*' matches any characters.")] = "*",
        max_points: Annotated[int, Query(ge=10, le=20_000)] = DEFAULT_MAX_POINTS,
        after: Annotated[
            int | None, Query(ge=0, description="A cursor from an earlier answer: only what came since.")
        ] = None,
    ) -> dict[str, Any]:
        """Each matching key's points, downsampled past ``max_points``; with ``after``, only the points
        logged since that cursor, in full. A ``cursor`` below the one sent means the file was rewritten
        (a resumed run): load again without ``after``."""
        patterns = [pattern.strip() for pattern in keys.split(",") if pattern.strip()]
        if len(patterns) > MAX_KEYS:
            raise ApiError(400, "too_many_keys", f"at most {MAX_KEYS} key patterns, got {len(patterns)}")
        with lock:
            metrics = runs.reader(run).metrics
            metrics.refresh()
            return {
                "run": run,
                "last_step": metrics.last_step,
                "cursor": metrics.cursor,
                "keys": metrics.keys,
                "series": metrics.series(metrics.matching(patterns), max_points, after),
            }

    @app.get("/api/runs/{run}/events", tags=["dashboard"], responses=NO_RUN)
    def run_events(run: str) -> dict[str, Any]:
        """Horizon stage starts and echo-trap warnings."""
        with lock:
            return runs.reader(run).events()

    @app.get("/api/runs/{run}/trajectories", tags=["dashboard"], responses=NO_RUN)
    def run_trajectories(
        run: str,
        env: str | None = None,
        group: str | None = None,
        seed: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        success: bool | None = None,
        policy_version: Annotated[int | None, Query(ge=0)] = None,
        status: Literal["kept", "filtered", "dropped"] | None = None,
        error: bool | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        """Recent episodes (the trainer's bounded trajectory log), newest first."""
        where = SampleFilter(
            env or None,
            group or None,
            seed or None,
            min_reward,
            max_reward,
            success,
            policy_version,
            status,
            error,
        )
        with lock:
            samples = runs.reader(run).samples
            samples.refresh()
            total, found = samples.query(where, limit)
            return {"run": run, "envs": samples.envs, "total": total, "trajectories": found}

    @app.get(
        "/api/runs/{run}/trajectories/{job_id}",
        tags=["dashboard"],
        responses=error_responses(404, descriptions={404: "No run of this name, or no such episode in it."}),
    )
    def run_trajectory(run: str, job_id: str, download: bool = False) -> Any:
        """One episode turn by turn, and its tokens as the trainer saw them."""
        with lock:
            reader = runs.reader(run)
            reader.samples.refresh()
            record = reader.samples.find(job_id)
            if record is None:
                raise not_found("trajectory", job_id)
            tokenizer_dir = reader.tokenizer_dir()
        body = summary(record) | {
            "run": run,
            "worker_id": record.get("worker_id"),
            "max_turns": record.get("max_turns"),
            "sampling": record.get("sampling"),
            "turns": record.get("turns", []),
            "tokens": {
                "ids": record.get("token_ids", []),
                "text": texts.texts(record.get("token_ids", []), tokenizer_dir),
                "mask": record.get("loss_mask", []),
                "logprobs": record.get("logprobs", []),
                "advantages": record.get("advantages"),
            },
        }
        if not download:
            return body
        filename = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)
        return OrjsonResponse(
            body, headers={"Content-Disposition": f'attachment; filename="trajectory-{filename}.json"'}
        )

    @app.get(
        "/api/runs/{run}/groups/{group_id}",
        tags=["dashboard"],
        responses=error_responses(404, descriptions={404: "No run of this name, or no such group in it."}),
    )
    def run_group(run: str, group_id: str) -> dict[str, Any]:
        """A group's episodes side by side: what StarPO-S kept or filtered."""
        with lock:
            samples = runs.reader(run).samples
            samples.refresh()
            members = samples.group(group_id)
        if not members:
            raise not_found("group", group_id)
        first = members[0]
        return {
            "run": run,
            "group_id": group_id,
            "step": first.get("step"),
            "status": first.get("status"),
            "reward_std": first.get("group_reward_std"),
            "trajectories": [
                summary(record) | {"replies": [turn.get("response", "") for turn in record.get("turns", [])]}
                for record in members
            ],
        }

    @app.get("/api/system", tags=["dashboard"])
    async def system_view() -> dict[str, Any]:
        """Env servers, rollout workers, engines, Redis streams: each with its health."""
        if system is None:
            return {"available": False, "reason": no_system_reason}
        return {"available": True, "reason": None} | await system()

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
