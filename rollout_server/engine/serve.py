"""``stargym engine serve``: load a model directory and serve it with the CPU engine on :8210."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rollout_server.engine.settings import EngineSettings
from services.serving import run_service, settings_from_flags

if TYPE_CHECKING:
    from rollout_server.engine.app import EngineState


def serve_command(
    model: Annotated[str | None, typer.Option(help="Hugging Face model directory [STARGYM_MODEL].")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address [STARGYM_HOST].")] = None,
    port: Annotated[int | None, typer.Option(help="Port, default 8210 [STARGYM_PORT].")] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(help="Sequences in flight; more get 429 [STARGYM_MAX_NUM_SEQS].")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Prompt plus max_tokens; longer gets 400 [STARGYM_MAX_MODEL_LEN].")
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name in requests and /v1/models [STARGYM_SERVED_MODEL_NAME].")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="torch intra-op threads [STARGYM_THREADS].")] = None,
    prefix_cache_mb: Annotated[
        float | None,
        typer.Option(help="Memory for reusing prompt prefixes, 0: off [STARGYM_PREFIX_CACHE_MB]."),
    ] = None,
    prefill_tokens: Annotated[
        int | None,
        typer.Option(
            help="Padded tokens per batched prefill pass; 0: each prompt alone [STARGYM_PREFILL_TOKENS]."
        ),
    ] = None,
) -> None:
    """Serve a causal LM over vLLM's engine protocol, batching all requests on the CPU."""
    overrides = {
        "model": model,
        "host": host,
        "port": port,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "served_model_name": served_model_name,
        "threads": threads,
        "prefix_cache_mb": prefix_cache_mb,
        "prefill_tokens": prefill_tokens,
    }
    settings = settings_from_flags(EngineSettings, overrides)
    state = load_engine(settings)
    from rollout_server.engine.app import build_app

    run_service(build_app(state), settings)


def load_engine(settings: EngineSettings, model_flag: str = "--model") -> EngineState:
    """The model of ``settings.model``, its tokenizer and its batching engine (not started): what
    ``stargym engine serve`` serves, and what ``stargym rollout --engine-model`` runs in its own
    process. A directory that is not a model (named as ``model_flag``), or a context past the
    model's positions, is a :class:`typer.BadParameter` (one line, exit 2)."""
    if not (Path(settings.model) / "config.json").is_file():
        raise typer.BadParameter(
            f"{settings.model!r} is not a Hugging Face model directory", param_hint=model_flag
        )
    # torch and transformers load here: every `stargym` command imports this module.
    import torch

    from rollout_server.engine.app import EngineState
    from rollout_server.engine.scheduler import Engine
    from services.policy import load_policy

    torch.set_num_threads(settings.threads)
    loaded, tokenizer = load_policy(settings.model)
    loaded.requires_grad_(False)
    positions = getattr(loaded.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and settings.max_model_len > positions:
        raise typer.BadParameter(
            f"{settings.max_model_len} exceeds the model's max_position_embeddings ({positions})",
            param_hint="--max-model-len",
        )
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else loaded.config.eos_token_id
    engine = Engine(
        loaded,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        eos_token_id=eos,
        extra_stop_token_ids=_generation_eos(loaded) - {eos},
        prefix_cache_bytes=int(settings.prefix_cache_mb * 2**20),
        prefill_tokens=settings.prefill_tokens or None,
    )
    return EngineState.create(engine, loaded, tokenizer, settings)


def _generation_eos(model) -> frozenset[int]:
    """End-of-sequence ids of the model's generation config (Qwen lists two); vLLM stops on all."""
    ids = model.generation_config.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
