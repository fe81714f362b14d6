"""The replicas behind a configured URL, found by DNS, and the choice of the least busy one.

A rollout worker is given URLs (``--env game=http://env-game:8101``, ``--engine-url``). Behind one
name there may be several servers: a Kubernetes headless Service (``clusterIP: None``) or a
``docker compose --scale`` service resolves to one address per replica. So a URL whose host
resolves to several addresses counts as one server per address (``http://<ip>:<port>``); an
IP-literal URL, or a name with one address, is one server shown as given (the name is kept, so
logs and the dashboard show it).

Each server (:class:`Endpoint`) is *connected to* at its address, even when shown by name: an
episode must create, step and close its env instance on one server, and a name that resolves to
one replica now may resolve to three a minute later (``kubectl scale``), when the HTTP client's
own lookup would send the episode's next request to any of them. Pinning the address also keeps
a replica the same server when its name goes from one address to several: only how it is shown
changes. Two kinds of URL are left to the HTTP client: ``https`` ones (a certificate names the
host, not its addresses; TLS endpoints are load balancers, not headless Services) and ones whose
name does not resolve yet. A name with IPv4 and IPv6 addresses (``localhost``, a dual-stack
Service) is taken at its IPv4 ones: each replica has one of each, and both would count it twice.

:class:`Discovery` re-resolves on demand and, when a lookup fails, keeps the last servers it knew
and says so once per failure streak. What is spread over the servers picks with
:func:`pick_least_busy` (fewest in flight, ties in turn). :class:`ServerPool` holds one client
per server of a kind (one env family's servers): a lease counts the work in flight on its
server; servers that vanish from DNS stop being picked, and their clients are closed once their
work is done.

It lives in ``services/`` because nothing in it is the worker's: the dashboard may resolve the
env servers and engines it is configured with the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import urlsplit, urlunsplit

from services.http_client import ServiceClient

logger = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C", bound=ServiceClient)

Resolver = Callable[[str], Awaitable[list[str]]]
"""``host → addresses``; the default is :func:`resolve_host` (the event loop's ``getaddrinfo``)."""

RESOLVE_TIMEOUT_S = 5.0
"""Longest wait for one lookup; a resolver that hangs longer counts as failed (last servers kept)."""


async def resolve_host(host: str) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6), sorted, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def with_host(url: str, address: str) -> str:
    """``url`` with its host replaced by ``address`` (an IPv6 one in brackets); the rest kept."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    host = f"[{address}]" if ":" in address else address
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}{port}"))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One server behind a configured URL."""

    url: str
    """How it is shown (logs, /status, the worker registry): the configured URL, or for a name
    with several addresses the URL with this server's address."""
    target: str
    """What requests go to: the URL with the address found (see the module docstring)."""

    @classmethod
    def unresolved(cls, url: str) -> Endpoint:
        return cls(url, url)


async def expand_url(url: str, resolver: Resolver = resolve_host) -> list[Endpoint]:
    """The servers behind ``url``: one per address its host resolves to (IPv4 ones if it has
    any), each connected to at its address; ``url`` itself, unresolved, for an IP literal or an
    https URL. Raises what the resolver raises, or OSError when it finds no address."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme != "http" or not host or is_ip_literal(host):
        return [Endpoint.unresolved(url)]
    addresses = sorted(set(await resolver(host)))
    ipv4 = [address for address in addresses if ":" not in address]
    addresses = ipv4 or addresses
    if not addresses:
        raise OSError(f"{host} resolves to no address")
    if len(addresses) == 1:
        return [Endpoint(url, with_host(url, addresses[0]))]
    return [Endpoint(shown, shown) for shown in (with_host(url, address) for address in addresses)]


class Discovery:
    """The servers behind some configured URLs, as of the last lookup of each that worked.

    Before the first :meth:`refresh` (and for a URL never resolved) the URL itself is the server:
    the HTTP client then resolves it when it connects, as it would without discovery.
    :attr:`servers` lists each target once (two configured names may share an address).

    Args:
        urls: the configured URLs, in order.
        resolver: ``host → addresses`` (tests inject one); default :func:`resolve_host`.
        what: how logs name these servers (``env servers of 'game'``, ``engines``).
    """

    def __init__(self, urls: Sequence[str], resolver: Resolver | None = None, *, what: str) -> None:
        if not urls:
            raise ValueError(f"{what}: at least one URL is needed")
        self.urls = list(dict.fromkeys(urls))
        self.resolver = resolver or resolve_host
        self.what = what
        self._known: dict[str, list[Endpoint]] = {url: [Endpoint.unresolved(url)] for url in self.urls}
        self._failing: set[str] = set()

    @property
    def servers(self) -> list[Endpoint]:
        """Every server now known, in configured order."""
        unique: dict[str, Endpoint] = {}
        for url in self.urls:
            for endpoint in self._known[url]:
                unique.setdefault(endpoint.target, endpoint)
        return list(unique.values())

    async def refresh(self) -> list[Endpoint]:
        """Resolve every configured URL again and return :attr:`servers`; never raises.

        A URL whose lookup fails (or hangs past :data:`RESOLVE_TIMEOUT_S`) keeps its last
        servers; the failure is logged when a streak starts and again when it ends, not on
        every refresh.
        """
        found = await asyncio.gather(
            *(asyncio.wait_for(expand_url(url, self.resolver), RESOLVE_TIMEOUT_S) for url in self.urls),
            return_exceptions=True,
        )
        for url, result in zip(self.urls, found, strict=True):
            if isinstance(result, BaseException):
                if url not in self._failing:
                    self._failing.add(url)
                    logger.warning(
                        "%s: cannot resolve %s (%s: %s); keeping %s until it resolves again",
                        self.what,
                        url,
                        type(result).__name__,
                        result,
                        _describe(self._known[url]),
                    )
                continue
            if url in self._failing:
                self._failing.discard(url)
                logger.info("%s: %s resolves again", self.what, url)
            if result != self._known[url]:
                logger.info("%s: %s is now %s", self.what, url, _describe(result))
                self._known[url] = result
        return self.servers


def _describe(endpoints: Sequence[Endpoint]) -> str:
    return ", ".join(e.url if e.url == e.target else f"{e.url} ({e.target})" for e in endpoints)


def pick_least_busy(items: Sequence[T], load: Callable[[T], int], turn: int) -> T:
    """The item with the smallest ``load``; among equals the first at or after index ``turn``
    (counting on from the last pick turns ties into round robin). Raises ValueError if empty."""
    if not items:
        raise ValueError("nothing to pick from")
    count = len(items)
    return min((items[(turn + offset) % count] for offset in range(count)), key=load)


@dataclass(eq=False)
class Server(Generic[C]):
    """One server of a pool: its client, the leases (work) in flight on it, whether it vanished."""

    url: str
    """How it is shown (:attr:`Endpoint.url`; changes when its name gains or loses addresses)."""
    target: str
    """What its client connects to (:attr:`Endpoint.target`): what identifies it."""
    client: C
    in_flight: int = 0
    retired: bool = False
    """Gone from DNS: takes no new work; closed once ``in_flight`` is back to 0."""


class ServerPool(Generic[C]):
    """The servers of one kind, one client each; :meth:`lease` the least busy for a unit of work.

    Args:
        make_client: the client of a server, given its :attr:`Endpoint.target` (opened and closed
            here).
    """

    def __init__(self, make_client: Callable[[str], C]) -> None:
        self._make_client = make_client
        self.servers: list[Server[C]] = []
        self._turn = itertools.count()

    @property
    def active(self) -> list[Server[C]]:
        """The servers new work may go to."""
        return [server for server in self.servers if not server.retired]

    async def update(self, endpoints: Sequence[Endpoint]) -> None:
        """Serve ``endpoints`` from now on: open a client for each new target, retire the servers
        not named (their work in flight finishes on them), take back retired ones named again,
        and close retired servers with nothing in flight."""
        if not endpoints:
            raise ValueError("a pool needs at least one server")
        wanted = {endpoint.target: endpoint for endpoint in endpoints}
        known = {server.target: server for server in self.servers}
        for target, endpoint in wanted.items():
            server = known.get(target)
            if server is None:
                client = self._make_client(target)
                await client.open()
                self.servers.append(Server(endpoint.url, target, client))
            else:
                server.url = endpoint.url
        for server in self.servers:
            server.retired = server.target not in wanted
        idle = [server for server in self.servers if server.retired and server.in_flight == 0]
        self.servers = [server for server in self.servers if server not in idle]
        for server in idle:
            with contextlib.suppress(Exception):
                await server.client.aclose()

    @contextlib.contextmanager
    def lease(self, avoid: Collection[str] = ()) -> Iterator[Server[C]]:
        """The least busy active server, its ``in_flight`` counted up for the ``with`` block.

        ``avoid``: targets not to pick while another active server is left (the ones a rerun
        already failed on: a dead server has nothing in flight, so it would look least busy).
        """
        others = [server for server in self.active if server.target not in avoid]
        server = pick_least_busy(others or self.active, lambda s: s.in_flight, next(self._turn))
        server.in_flight += 1
        try:
            yield server
        finally:
            server.in_flight -= 1

    async def aclose(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.client.aclose()
        self.servers = []
