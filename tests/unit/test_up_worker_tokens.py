"""``stargym up`` passes ``STARGYM_API_TOKEN`` on as the worker's outgoing tokens (deploy.up.worker_tokens)."""

from __future__ import annotations

from deploy.up import worker_tokens

ENV_VAR, ENGINE_VAR = "STARGYM_ROLLOUT_ENV_API_TOKEN", "STARGYM_ROLLOUT_ENGINE_API_TOKEN"


def test_the_shared_token_becomes_the_workers_outgoing_tokens() -> None:
    assert worker_tokens({"STARGYM_API_TOKEN": "t"}) == {ENV_VAR: "t", ENGINE_VAR: "t"}


def test_a_token_set_for_the_worker_is_kept() -> None:
    environ = {"STARGYM_API_TOKEN": "t", ENGINE_VAR: "vllm-key"}
    assert worker_tokens(environ) == {ENV_VAR: "t", ENGINE_VAR: "vllm-key"}


def test_no_shared_token_adds_nothing() -> None:
    assert worker_tokens({}) == {}
    assert worker_tokens({"STARGYM_API_TOKEN": " ", ENV_VAR: "e"}) == {}  # empty means unset
