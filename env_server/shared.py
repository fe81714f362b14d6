"""What every instance of an env class in one server process shares (a corpus, a catalog, an index).

Loaded once, by the first caller (``Env.prepare`` at server start, or the first reset), while
concurrent callers on the host's worker threads wait for it. What a user got wrong while loading
becomes an :class:`~env_server.core.EnvFailure` that names it, so ``stargym env serve`` stops with
that message (exit 2) and a create answers 502 with it, instead of a stack trace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from pydantic import ValidationError

from env_server.core import EnvFailure
from services.errors import validation_problems

T = TypeVar("T")


class ProcessShared(Generic[T]):
    """``load()``'s result, made by the first :meth:`get` of the process.

    ``family`` names the settings in messages (``search settings: corpus: ...``); a pydantic
    ``ValidationError`` is a bad setting, and any of ``file_errors`` (whose messages name the
    file and line) an unreadable data file.
    """

    def __init__(self, family: str, load: Callable[[], T], file_errors: tuple[type[Exception], ...]) -> None:
        self.family = family
        self._load = load
        self._file_errors = file_errors
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                try:
                    self._value = self._load()
                except ValidationError as exc:
                    raise EnvFailure(
                        f"{self.family} settings: {validation_problems(exc, 'settings')}"
                    ) from None
                except self._file_errors as exc:
                    raise EnvFailure(str(exc)) from None
            return self._value
