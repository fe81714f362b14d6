"""Settings of the CPU engine server, read from ``STARGYM_*`` variables and ``stargym engine serve`` flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from services.settings import ServiceSettings


def default_threads() -> int:
    """Half the cores: the other half serves HTTP and the services beside the engine.

    Measured on a busy 2-core machine, two intra-op threads made a tiny-model step 20-100 times
    slower than one (the OpenMP threads wait on each other), so 2 cores get 1 thread.
    """
    return max(1, (os.cpu_count() or 2) // 2)


class EngineSettings(ServiceSettings):
    """The CPU engine: which model it serves and the limits that bound its memory."""

    port: int = 8210
    model: str = Field(default="models/tiny", description="A local Hugging Face causal-LM directory.")
    served_model_name: str | None = Field(default=None, description="Name in /v1/models; default: the path.")
    max_num_seqs: int = Field(default=64, gt=0, description="Sequences in flight; more get 429.")
    max_model_len: int = Field(default=2048, gt=1, description="Prompt plus max_tokens; longer gets 400.")
    threads: int = Field(default_factory=default_threads, gt=0, description="torch intra-op threads.")
    prefix_cache_mb: float = Field(
        default=256.0, ge=0, description="KV of finished sequences kept for prompts that extend them; 0: off."
    )
    prefill_tokens: int = Field(
        default=2048,
        ge=0,
        description="Rows x widest chunk of one batched prefill pass (a longer prompt is prefilled in "
        "chunks between decode steps); 0: each prompt whole, in a pass of its own, as before batching.",
    )
    weights_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Directories (os.pathsep-separated) whose subdirectories reload_weights may load; "
        "empty: the model directory's parent and the working directory, where trainers publish "
        "policy-v<N>/ (checkpoints/<run>/ under the working directory, or a run dir beside the model).",
    )

    @field_validator("weights_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        return [part for part in value.split(os.pathsep) if part] if isinstance(value, str) else value

    def allowed_weights_roots(self) -> list[Path]:
        """The resolved roots a reload may read below (symlinks resolved, so none leads out)."""
        roots = self.weights_roots or [str(Path(self.model).resolve().parent), os.getcwd()]
        return [Path(root).resolve() for root in roots]
