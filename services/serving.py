"""Starting a service from its command: flags over settings, then uvicorn. Shared by every ``serve``.

    settings = settings_from_flags(EngineSettings, {"model": model, "port": port})
    run_service(build_app(settings), settings)

A flag that was not given (None) leaves the setting to its environment variable or default; a
value the settings refuse is a :class:`typer.BadParameter` (one line, exit 2), never a traceback.
"""

from __future__ import annotations

from typing import Any, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def settings_from_flags(settings_class: type[S], flags: dict[str, Any]) -> S:
    """``settings_class`` read from the environment, with the flags that were given on top."""
    try:
        return settings_class(**{name: value for name, value in flags.items() if value is not None})
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None


def run_service(app: Any, settings: Any) -> None:
    """Serve ``app`` on the settings' ``host``/``port`` at their ``log_level`` until stopped.

    uvloop and httptools (measured faster than asyncio and h11 for our small JSON requests), no
    access log (a line per request costs more than the request). uvicorn loads here, not at import:
    every ``stargym`` command imports the serve modules.
    """
    import uvicorn

    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
    )
