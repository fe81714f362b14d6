"""The variants TextArena registers for a game, read from its registry.

``register_with_versions`` files every variant ``X`` three times: ``X`` (TextArena's LLM wrappers),
``X-train`` (other wrappers) and ``X-raw`` (none). The three differ only in how observations are
rendered, which this family does itself, so a game's variants are the ids that have a ``-raw`` twin:
``2048-v0`` and ``2048-v0-3x3`` are variants, ``2048-v0-train`` is not.
"""

from __future__ import annotations

from textarena.envs.registration import ENV_REGISTRY

RAW = "-raw"  # the id suffix of a variant without wrappers: the raw message lists this family renders


def variants_of(variant: str) -> tuple[str, ...]:
    """Every variant of the game ``variant`` belongs to (the same entry point), in registry order."""
    entry_point = ENV_REGISTRY[variant].entry_point
    return tuple(
        env_id
        for env_id, spec in ENV_REGISTRY.items()
        if spec.entry_point == entry_point and env_id + RAW in ENV_REGISTRY
    )
