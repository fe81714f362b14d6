"""The system view's pure parts: token counters from Prometheus text, their rates, URL redaction,
the snapshot cache, and the address a rollout worker advertises in the registry."""

from __future__ import annotations

import socket

import pytest

from rollout_server.settings import WorkerSettings
from services.rollout_protocol import WorkerHeartbeat
from services.settings import redact_url
from trainer.dashboard.system import CounterRates, SystemProbe, generated_tokens

CPU_ENGINE_METRICS = """\
# HELP engine_sequences_in_flight Admitted sequences
# TYPE engine_sequences_in_flight gauge
engine_sequences_in_flight 2.0
# HELP engine_generated_tokens_total Tokens sampled
# TYPE engine_generated_tokens_total counter
engine_generated_tokens_total 1500.0
# HELP engine_prompt_tokens_total Prompt tokens of admitted requests
# TYPE engine_prompt_tokens_total counter
engine_prompt_tokens_total 99999.0
"""
VLLM_METRICS = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 5000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 700.0
vllm:generation_tokens_total{engine="1",model_name="m"} 300.0
"""


def test_generated_tokens_reads_our_counter_and_vllms_summed_over_labels() -> None:
    assert generated_tokens(CPU_ENGINE_METRICS) == 1500.0
    assert generated_tokens(VLLM_METRICS) == 1000.0
    assert generated_tokens("# TYPE other_total counter\nother_total 3.0\n") is None


def test_counter_rates_start_after_two_readings_and_restart_when_the_counter_goes_back() -> None:
    rates = CounterRates()
    assert rates.update("e", 1500.0, now=10.0) is None
    assert rates.update("e", 2100.0, now=12.0) == pytest.approx(300.0)
    assert rates.update("other", 5.0, now=12.0) is None  # one series per engine
    assert rates.update("e", 40.0, now=13.0) is None  # a restarted engine counts from 0 again
    assert rates.update("e", 140.0, now=14.0) == pytest.approx(100.0)


def test_redact_url_hides_the_password_only() -> None:
    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("redis://user:s3cret@10.0.0.1:6379") == "redis://user:***@10.0.0.1:6379"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_a_snapshot_is_cached_and_without_redis_says_so() -> None:
    async with SystemProbe(None, {}, None, run_id="run", cache_s=60.0) as probe:
        first = await probe.snapshot()
        assert await probe.snapshot() is first
    assert not first.redis.ok and "no Redis URL" in first.redis.error
    assert first.workers == first.env_servers == first.engines == [] and first.trainer is None


def test_the_advertised_url_is_reachable_from_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings(host="127.0.0.1", port=8201).advertised_url == "http://127.0.0.1:8201"
    assert WorkerSettings(host="0.0.0.0", port=8200).advertised_url == f"http://{socket.gethostname()}:8200"
    assert WorkerSettings(host="::1", port=8200).advertised_url == "http://[::1]:8200"
    monkeypatch.setenv("STARGYM_ROLLOUT_ADVERTISE_URL", "http://rollout:8200/")
    monkeypatch.setenv("STARGYM_ROLLOUT_HEARTBEAT_S", "0.5")
    settings = WorkerSettings(host="0.0.0.0")
    assert (settings.advertised_url, settings.heartbeat_s) == ("http://rollout:8200", 0.5)


def test_a_registry_entry_is_aged_even_when_it_cannot_be_parsed() -> None:
    assert WorkerHeartbeat.updated_at_of(b'{"updated_at": 12.5, "from": "a newer version"}') == 12.5
    assert WorkerHeartbeat.updated_at_of(b"{not json") == 0.0
    assert WorkerHeartbeat.updated_at_of(b"[1, 2]") == 0.0
