"""This engine's limits in its OpenAPI document: what ``n``, token ids and lengths it serves.

They are settings of the server (``max_num_seqs``, ``max_model_len``) and of its model (the
vocabulary), so the models of :mod:`services.engine_protocol` cannot state them; each server's
document does, and the handlers refuse what breaks them with vLLM's 400s. What no schema states,
a prompt that with its ``max_tokens`` overflows the context, the routes list as a refusal
(:func:`services.openapi.refusals`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from rollout_server.engine.settings import EngineSettings
from services.openapi import extend_openapi

REQUESTS = ("CompletionRequest", "ChatCompletionRequest")


def document_limits(app: FastAPI, settings: EngineSettings, vocab_size: int) -> None:
    extend_openapi(app, lambda document: _add_limits(document["components"]["schemas"], settings, vocab_size))


def _add_limits(components: dict[str, Any], settings: EngineSettings, vocab_size: int) -> None:
    longest_reply = settings.max_model_len - 1  # the prompt has a token at least
    for name in REQUESTS:
        components[name]["properties"]["n"]["maximum"] = settings.max_num_seqs
    # A completion's max_tokens alone can overflow the context; a chat's is one of two limits
    # (max_completion_tokens), the smaller of which counts.
    completion = components["CompletionRequest"]["properties"]
    for branch in completion["max_tokens"]["anyOf"]:
        if branch.get("type") == "integer":
            branch["maximum"] = longest_reply
    for branch in completion["prompt"]["anyOf"]:
        if branch.get("type") == "array":  # token ids (a stop token past the vocabulary is harmless)
            branch["items"]["maximum"] = vocab_size - 1
            branch["maxItems"] = longest_reply
