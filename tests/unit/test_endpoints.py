"""Replicas behind a URL: the ``--env`` syntax, DNS expansion, re-resolution, least-busy picking."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from services import endpoints
from services.contracts import parse_env_servers, parse_family_urls
from services.endpoints import (
    Discovery,
    Endpoint,
    ServerPool,
    expand_url,
    pick_least_busy,
    resolve_host,
    with_host,
)
from services.http_client import ServiceClient
from services.rollout_protocol import WorkerHeartbeat, WorkerStatus


class FakeResolver:
    """``host → addresses`` from a dict the test edits; a missing host fails as DNS would."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        if host not in self.table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return list(self.table[host])


def at(*urls: str) -> list[Endpoint]:
    """Servers connected to as shown (IP literals)."""
    return [Endpoint.unresolved(url) for url in urls]


def shown(endpoints: list[Endpoint]) -> list[str]:
    return [endpoint.url for endpoint in endpoints]


class FakeClient(ServiceClient):
    def __init__(self, url: str) -> None:
        self.url = url
        self.opened = self.closed = False

    async def open(self) -> None:
        self.opened = True

    async def aclose(self) -> None:
        self.closed = True


# -- the --env syntax ---------------------------------------------------------------------------


def test_env_servers_take_several_urls_per_family_and_read_the_old_form_as_before() -> None:
    assert parse_env_servers("game=http://a:8101,http://b:8101/;search=http://s:8103") == {
        "game": ["http://a:8101", "http://b:8101"],
        "search": ["http://s:8103"],
    }
    assert parse_env_servers("game=http://g:8101,search=http://s:8103") == {
        "game": ["http://g:8101"],
        "search": ["http://s:8103"],
    }
    # A repeated --env: each item alone.
    assert parse_env_servers(["game=http://a,http://b", "web=http://w"]) == {
        "game": ["http://a", "http://b"],
        "web": ["http://w"],
    }
    assert parse_env_servers({"game": "http://a", "web": ["http://w1", "http://w2"]}) == {
        "game": ["http://a"],
        "web": ["http://w1", "http://w2"],
    }
    # The one-server-per-family form (stargym eval) is unchanged.
    assert parse_family_urls("game=http://g:8101,search=http://s:8103") == {
        "game": "http://g:8101",
        "search": "http://s:8103",
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("game", "must be FAMILY=URL"),
        ("http://a:8101", "must follow FAMILY=URL"),
        (["game=http://a", "http://b"], "must follow FAMILY=URL"),
        ("game/frozenlake=http://g", "is an env id"),
        ("game=http://a,game=http://b", "given twice"),
        ("game=http://a,http://a/", "names a server twice"),
        ("game=ftp://a", "must start with http://"),
        ("", "at least one env server"),
    ],
)
def test_env_servers_refuse_what_is_not_family_equals_urls(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_env_servers(value)


def test_one_server_per_family_refuses_several() -> None:
    with pytest.raises(ValueError, match="give one server here, not 2"):
        parse_family_urls("game=http://a,http://b")


# -- expanding a URL ----------------------------------------------------------------------------


def test_with_host_keeps_scheme_port_path_and_brackets_ipv6() -> None:
    assert with_host("http://env-game:8101", "10.0.0.7") == "http://10.0.0.7:8101"
    assert with_host("https://u:p@vllm:8000/v1", "fd00::7") == "https://u:p@[fd00::7]:8000/v1"
    assert with_host("http://env-game", "10.0.0.7") == "http://10.0.0.7"


async def test_a_name_with_several_addresses_is_one_server_per_address() -> None:
    resolver = FakeResolver(
        {
            "env-game": ["10.0.0.9", "10.0.0.7", "10.0.0.9"],
            "single": ["10.0.0.1"],
            "dual": ["::1", "127.0.0.1"],
            "v6": ["fd00::2", "fd00::1"],
            "none": [],
        }
    )
    assert await expand_url("http://env-game:8101", resolver) == at(
        "http://10.0.0.7:8101", "http://10.0.0.9:8101"
    )
    # One address: shown by its name (logs, dashboard), connected to at its address, so that
    # an episode stays on it when the name later resolves to several replicas.
    assert await expand_url("http://single:8101/", resolver) == [
        Endpoint("http://single:8101/", "http://10.0.0.1:8101/")
    ]
    # IPv4 and IPv6 addresses of one host are one server; IPv6 alone is used as it is.
    assert await expand_url("http://dual:1", resolver) == [Endpoint("http://dual:1", "http://127.0.0.1:1")]
    assert await expand_url("http://v6:1", resolver) == at("http://[fd00::1]:1", "http://[fd00::2]:1")
    # IP literals and https URLs are never looked up.
    for url in ("http://127.0.0.1:8101", "http://[::1]:8101", "https://env-game:8101"):
        assert await expand_url(url, resolver) == at(url)
    assert resolver.asked == ["env-game", "single", "dual", "v6"]
    with pytest.raises(OSError, match="no address"):
        await expand_url("http://none:8101", resolver)


async def test_the_default_resolver_asks_the_system() -> None:
    addresses = await resolve_host("localhost")
    assert addresses and set(addresses) <= {"127.0.0.1", "::1"}


# -- re-resolving -------------------------------------------------------------------------------


async def test_discovery_follows_scaling_and_keeps_the_last_servers_when_dns_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resolver = FakeResolver({"env-game": ["10.0.0.1"]})
    discovery = Discovery(["http://env-game:8101", "http://127.0.0.1:9"], resolver, what="env servers")
    # Before any lookup the configured URLs themselves (the HTTP client resolves them).
    assert discovery.servers == at("http://env-game:8101", "http://127.0.0.1:9")
    assert await discovery.refresh() == [
        Endpoint("http://env-game:8101", "http://10.0.0.1:8101"),
        *at("http://127.0.0.1:9"),
    ]
    resolver.table["env-game"] += ["10.0.0.2", "10.0.0.3"]  # scaled up: the first keeps its target
    scaled = at("http://10.0.0.1:8101", "http://10.0.0.2:8101", "http://10.0.0.3:8101", "http://127.0.0.1:9")
    assert await discovery.refresh() == scaled

    del resolver.table["env-game"]  # DNS down: three failed refreshes, one warning
    caplog.set_level(logging.INFO, logger=endpoints.__name__)
    for _ in range(3):
        assert await discovery.refresh() == scaled
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot resolve http://env-game:8101" in warnings[0].getMessage()

    resolver.table["env-game"] = ["10.0.0.2"]  # back, scaled down to one: the name again
    assert shown(await discovery.refresh()) == ["http://env-game:8101", "http://127.0.0.1:9"]
    assert any("resolves again" in record.getMessage() for record in caplog.records)
    del resolver.table["env-game"]
    await discovery.refresh()  # a new streak warns again
    assert sum(record.levelno == logging.WARNING for record in caplog.records) == 2


async def test_two_names_for_one_address_are_one_server() -> None:
    resolver = FakeResolver({"a": ["10.0.0.1"], "b": ["10.0.0.1"]})
    discovery = Discovery(["http://a:1", "http://b:1"], resolver, what="engines")
    assert await discovery.refresh() == [Endpoint("http://a:1", "http://10.0.0.1:1")]


async def test_a_lookup_that_hangs_counts_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoints, "RESOLVE_TIMEOUT_S", 0.05)

    async def hang(host: str) -> list[str]:
        await asyncio.sleep(60)
        return []

    discovery = Discovery(["http://slow:1"], hang, what="engines")
    async with asyncio.timeout(2):
        assert await discovery.refresh() == at("http://slow:1")


# -- picking ------------------------------------------------------------------------------------


def test_least_busy_wins_and_ties_go_round_robin() -> None:
    load = {"a": 0, "b": 0, "c": 0}
    picks = [pick_least_busy(["a", "b", "c"], load.__getitem__, turn) for turn in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    load["a"] = 2
    load["c"] = 1
    assert {pick_least_busy(["a", "b", "c"], load.__getitem__, turn) for turn in range(3)} == {"b"}
    with pytest.raises(ValueError):
        pick_least_busy([], len, 0)


async def test_a_pool_spreads_leases_evenly() -> None:
    pool = ServerPool(FakeClient)
    await pool.update(at("http://a", "http://b", "http://c"))
    assert all(server.client.opened for server in pool.servers)
    served = Counter()
    with pool.lease() as first, pool.lease() as second, pool.lease() as third:
        assert {first.url, second.url, third.url} == {"http://a", "http://b", "http://c"}
        with pool.lease() as fourth:
            assert fourth.in_flight == 2
    for _ in range(30):  # one at a time: round robin
        with pool.lease() as server:
            served[server.url] += 1
    assert set(served.values()) == {10}


async def test_a_lease_avoids_the_servers_named_while_another_is_left() -> None:
    pool = ServerPool(FakeClient)
    await pool.update(at("http://a", "http://b", "http://c"))
    a, b, c = pool.servers
    with pool.lease() as busy:  # a dead server holds nothing: without avoid it would win
        assert busy is a
    for _ in range(4):
        with pool.lease(avoid={a.target}) as server:
            assert server in (b, c)
    with pool.lease(avoid={a.target, c.target}) as server:
        assert server is b
    with pool.lease(avoid={a.target, b.target, c.target}) as server:  # none left: any will do
        assert server in (a, b, c)


async def test_a_vanished_server_gets_no_new_work_and_is_closed_once_idle() -> None:
    pool = ServerPool(FakeClient)
    await pool.update(at("http://a", "http://b"))
    a, b = pool.servers
    with pool.lease() as running:
        assert running is a
        await pool.update(at("http://b"))
        assert a.retired and not a.client.closed  # its work in flight finishes on it
        for _ in range(3):
            with pool.lease() as server:
                assert server is b
        assert pool.active == [b]
    await pool.update(at("http://b"))
    assert a.client.closed and pool.servers == [b]

    await pool.update(at("http://b", "http://a"))  # back: a new client
    assert [server.url for server in pool.servers] == ["http://b", "http://a"]
    assert not pool.servers[1].client.closed and pool.servers[1] is not a
    with pytest.raises(ValueError):
        await pool.update([])
    await pool.aclose()
    assert pool.servers == []


async def test_a_retired_server_named_again_before_it_closed_is_taken_back() -> None:
    pool = ServerPool(FakeClient)
    await pool.update(at("http://a", "http://b"))
    a = pool.servers[0]
    with pool.lease():
        await pool.update(at("http://b"))
        assert a.retired
        await pool.update(at("http://a", "http://b"))
        assert not a.retired and not a.client.closed and len(pool.servers) == 2


async def test_a_server_whose_name_gains_addresses_stays_the_same_server() -> None:
    """Scaling 1 → 2: the replica the name pointed at keeps its client and its work in flight."""
    pool = ServerPool(FakeClient)
    await pool.update([Endpoint("http://env-game:1", "http://10.0.0.1:1")])
    (first,) = pool.servers
    assert first.client.url == "http://10.0.0.1:1"  # connected to at its address
    with pool.lease():
        await pool.update(at("http://10.0.0.1:1", "http://10.0.0.2:1"))
        assert pool.servers[0] is first and first.url == "http://10.0.0.1:1" and first.in_flight == 1
        assert not first.retired and not first.client.closed and len(pool.servers) == 2


# -- the wire -----------------------------------------------------------------------------------


def test_a_heartbeat_lists_every_server_of_a_family_and_reads_the_one_url_form() -> None:
    status = WorkerStatus.model_validate(
        {
            "worker_id": "w",
            "concurrency": 1,
            "in_flight": 0,
            "episodes_per_s": 0,
            "tokens_per_s": 0,
            "policy_version": None,
            "target_policy_version": None,
            "jobs_done": 0,
            "jobs_failed": 0,
            "duplicates": 0,
            "reclaimed": 0,
            "env_retries": 0,
            "engine_backoffs": 0,
            "reloads": 0,
            "redis_errors": 0,
            "engines": [{"url": "http://e", "policy_version": 0, "in_flight": 0, "reloading": False}],
            "stopping": False,
            "uptime_s": 1,
        }
    )  # a status of a worker from before env_servers, ready and retired
    assert status.env_servers == [] and status.engines[0].ready and not status.engines[0].retired
    fields = {"worker_id": "w", "url": None, "engines": [], "heartbeat_s": 2, "updated_at": 0}
    new = WorkerHeartbeat(**fields, envs={"game": ["http://a", "http://b"]}, status=status)
    old = WorkerHeartbeat.model_validate_json(
        new.model_dump_json().replace('["http://a","http://b"]', '"http://a"')
    )
    assert new.envs == {"game": ["http://a", "http://b"]} and old.envs == {"game": ["http://a"]}
