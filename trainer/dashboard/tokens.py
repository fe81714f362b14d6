"""Token ids to text for the dashboard's token view, with each run's own tokenizer.

Each token is decoded alone (``decode([id])``), so the view shows exactly where the tokenizer
cut the text: a re-tokenisation bug (the same text split differently on the next turn) is
visible as differently cut tokens. Tokenizers are loaded once per directory and kept.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class TokenTexts:
    """Decodes token ids with the tokenizer of a directory (a policy or model directory)."""

    def __init__(self) -> None:
        self._tokenizers: dict[Path, Any] = {}
        self._failed: set[Path] = set()
        self._lock = threading.Lock()

    def _tokenizer(self, directory: Path) -> Any | None:
        with self._lock:
            if directory in self._tokenizers:
                return self._tokenizers[directory]
            if directory in self._failed:
                return None
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(directory))
            except (OSError, ValueError) as exc:
                logger.warning("no tokenizer in %s (%s): the token view shows ids", directory, exc)
                self._failed.add(directory)
                return None
            self._tokenizers[directory] = tokenizer
            return tokenizer

    def texts(self, token_ids: list[int], directory: Path | None) -> list[str]:
        """One string per id; ``#<id>`` for every id when no tokenizer can be loaded."""
        tokenizer = None if directory is None else self._tokenizer(directory)
        if tokenizer is None:
            return [f"#{token_id}" for token_id in token_ids]
        return tokenizer.batch_decode([[token_id] for token_id in token_ids])
