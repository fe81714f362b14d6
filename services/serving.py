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


# How long an idle keep-alive connection stays open on the server. uvicorn's default, 5 s, is
# exactly how long httpx (and so the openai package) pools an idle connection, and 1 s above our
# own client's 4 s: a request sent on a pooled connection as the server's timer fired was dropped
# unanswered (CI's leak test: "Server disconnected without sending a response" after a 5 s idle),
# and a step or completion that was dropped cannot be re-sent. A stall of either side on a loaded
# machine widens that window. 75 s is nginx's default; an idle connection costs a file descriptor.
KEEP_ALIVE_S = 75


def uvicorn_options(settings: Any) -> dict[str, Any]:
    """The uvicorn settings every service runs under, from its settings' ``host``/``port``/``log_level``.

    uvloop and httptools (measured faster than asyncio and h11 for our small JSON requests), no
    access log (a line per request costs more than the request), and :data:`KEEP_ALIVE_S`.
    """
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": False,
        "loop": "uvloop",
        "http": "httptools",
        "timeout_keep_alive": KEEP_ALIVE_S,
    }


def run_service(app: Any, settings: Any, **options: Any) -> None:
    """Serve ``app`` with :func:`uvicorn_options` (``options``, uvicorn's own, on top) until stopped.

    uvicorn loads here, not at import: every ``stargym`` command imports the serve modules.
    """
    import uvicorn

    uvicorn.run(app, **uvicorn_options(settings), **options)
