"""``services.env_client.EnvClient`` against real env servers (and a few misbehaving fake ones).

Round trips return the protocol's pydantic models; server errors arrive as ``EnvServerError``
with the status and the code of the JSON error body; only requests that never reached a server
are retried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import RunningServer, free_port, start_server, stop_server

from services.env_client import EnvClient, EnvConnectionError, EnvServerError, EnvTimeoutError
from services.env_protocol import (
    BatchStepOutcome,
    EnvSpec,
    Health,
    InstanceCreated,
    InstanceList,
    InstanceState,
    Observed,
    StepResult,
)

FROZENLAKE = "game/frozenlake"
BANDIT = "game/bandit"
MISSING = "00000000-0000-0000-0000-000000000000"


@pytest.fixture
async def client(game_server: RunningServer) -> AsyncIterator[EnvClient]:
    async with EnvClient(game_server.url, timeout=30.0) as env_client:
        yield env_client


async def finished_bandit(client: EnvClient) -> str:
    """A bandit instance whose one-turn episode is over."""
    created = await client.create(BANDIT, seed=1)
    arm = created.info["arms"][0]
    assert (await client.step(created.instance_id, arm)).done
    return created.instance_id


# ---------------------------------------------------------------- round trips


async def test_health_and_envs(client: EnvClient) -> None:
    health = await client.health()
    assert isinstance(health, Health) and health.status == "ok"
    envs = await client.list_envs()
    assert all(isinstance(spec, EnvSpec) for spec in envs)
    assert {FROZENLAKE, BANDIT} <= {spec.id for spec in envs}


async def test_lifecycle_round_trip(client: EnvClient) -> None:
    created = await client.create(FROZENLAKE, seed=7, options={"size": 4})
    assert isinstance(created, InstanceCreated)
    instance_id = created.instance_id

    state = await client.get(instance_id)
    assert isinstance(state, InstanceState)
    assert (state.env, state.seed, state.turns, state.done) == (FROZENLAKE, 7, 0, False)
    assert state.observation == created.observation
    assert await client.available_actions(instance_id) == ["Left", "Down", "Right", "Up"]

    step = await client.step(instance_id, "no such move")
    assert isinstance(step, StepResult)
    assert step.info["valid"] is False and step.reward == 0.0 and step.done is False
    step = await client.step(instance_id, "Right")
    assert step.info["valid"] is True
    assert (await client.get(instance_id)).turns == 2

    observed = await client.reset(instance_id)  # same seed: the same first observation
    assert isinstance(observed, Observed)
    assert observed.observation == created.observation
    assert (await client.get(instance_id)).turns == 0
    reseeded = await client.reset(instance_id, seed=8, options={"size": 5})
    assert (await client.get(instance_id)).seed == 8
    assert len(reseeded.observation.splitlines()[0].split()) == 5

    listed = await client.list_instances()
    assert isinstance(listed, InstanceList)
    assert instance_id in {state.instance_id for state in listed.instances}

    assert await client.close(instance_id) is None
    with pytest.raises(EnvServerError) as raised:
        await client.get(instance_id)
    assert (raised.value.status, raised.value.code) == (404, "not_found")


async def test_same_seed_same_episode(client: EnvClient) -> None:
    first, second = await asyncio.gather(*(client.create(FROZENLAKE, seed=11) for _ in range(2)))
    assert first.instance_id != second.instance_id
    assert first.observation == second.observation
    steps = [await client.step(i.instance_id, "Down") for i in (first, second)]
    assert steps[0] == steps[1]


async def test_step_many(client: EnvClient) -> None:
    lake = await client.create(FROZENLAKE, seed=3)
    bandit = await client.create(BANDIT, seed=3)
    arm = bandit.info["arms"][1]
    outcomes = await client.step_many(
        [
            (lake.instance_id, "Up"),
            (bandit.instance_id, arm),  # ends the bandit's episode ...
            (MISSING, "Up"),
            (bandit.instance_id, arm),  # ... so its second step in the batch is refused
            (lake.instance_id, "not a move"),
        ]
    )
    assert all(isinstance(outcome, BatchStepOutcome) for outcome in outcomes)
    assert [o.instance_id for o in outcomes] == [
        lake.instance_id,
        bandit.instance_id,
        MISSING,
        bandit.instance_id,
        lake.instance_id,
    ]
    assert outcomes[0].result is not None and outcomes[0].error is None
    assert outcomes[1].result is not None and outcomes[1].result.done
    assert outcomes[2].error is not None and outcomes[2].error.code == "not_found"
    assert outcomes[3].error is not None and outcomes[3].error.code == "episode_done"
    assert outcomes[4].result is not None and outcomes[4].result.info["valid"] is False
    assert (await client.get(lake.instance_id)).turns == 2
    assert await client.step_many([]) == []


# ---------------------------------------------------------------- server errors


async def test_unknown_instance_is_404(client: EnvClient) -> None:
    for call in (
        lambda: client.step(MISSING, "Up"),
        lambda: client.reset(MISSING),
        lambda: client.get(MISSING),
        lambda: client.close(MISSING),
    ):
        with pytest.raises(EnvServerError) as raised:
            await call()
        assert raised.value.status == 404
        assert raised.value.code == "not_found"
        assert MISSING in raised.value.message


async def test_odd_instance_ids_stay_in_their_path_segment(client: EnvClient) -> None:
    """An id is quoted into one path segment: "../../envs" cannot reach GET /envs."""
    for odd in ("../../envs", "a b?c#d"):
        with pytest.raises(EnvServerError) as raised:
            await client.step(odd, "Up")
        assert (raised.value.status, raised.value.code) == (404, "not_found")


async def test_unknown_env_is_404(client: EnvClient) -> None:
    with pytest.raises(EnvServerError) as raised:
        await client.create("game/no-such-game")
    assert (raised.value.status, raised.value.code) == (404, "not_found")
    assert "game/no-such-game" in str(raised.value)


async def test_step_after_done_is_409(client: EnvClient) -> None:
    instance_id = await finished_bandit(client)
    with pytest.raises(EnvServerError) as raised:
        await client.step(instance_id, "anything")
    assert (raised.value.status, raised.value.code) == (409, "episode_done")
    await client.reset(instance_id)  # and a reset makes the instance playable again
    assert not (await client.step(instance_id, "not an arm")).done


async def test_invalid_input_is_422(client: EnvClient) -> None:
    with pytest.raises(EnvServerError) as raised:
        await client.create(FROZENLAKE, seed=-1)
    assert (raised.value.status, raised.value.code) == (422, "validation_error")
    assert "seed" in raised.value.message
    with pytest.raises(EnvServerError) as raised:
        await client.create(FROZENLAKE, options={"size": 1000})
    assert (raised.value.status, raised.value.code) == (422, "invalid_options")
    assert "size" in raised.value.message


# The step, batched step and reset routes answer plain JSON bodies on a fast path that skips
# FastAPI's request handling; anything else goes to FastAPI's own handler. A "+json" media type
# is JSON to FastAPI but not plain to the fast path, so it shows what the regular handler says.
FAST, REGULAR = "application/json", "application/vnd.test+json"


async def twin_answers(http: httpx.AsyncClient, paths: tuple[str, str], body: bytes) -> list[tuple]:
    """The same request on two twin instances, one through each path; the answers to compare."""
    answers = []
    for path, content_type in zip(paths, (FAST, REGULAR), strict=True):
        response = await http.post(path, content=body, headers={"content-type": content_type})
        text = response.text
        for twin_path in paths:  # error messages name the instance: the twins' ids differ
            text = text.replace(twin_path.split("/")[2], "ID")
        answers.append((response.status_code, response.headers["content-type"], text))
    return answers


@pytest.fixture
async def http(game_server: RunningServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=game_server.url, timeout=30.0) as http_client:
        yield http_client


async def twins(http: httpx.AsyncClient, env: str = FROZENLAKE, seed: int = 5) -> list[str]:
    return [
        (await http.post("/instances", json={"env": env, "seed": seed})).json()["instance_id"]
        for _ in range(2)
    ]


async def test_step_fast_path_answers_as_the_regular_handler(http: httpx.AsyncClient) -> None:
    ids = await twins(http)
    for action in ("Down", "Right", "sideways", "Down", "Left"):
        paths = (f"/instances/{ids[0]}/step", f"/instances/{ids[1]}/step")
        fast, regular = await twin_answers(http, paths, b'{"action": "%s"}' % action.encode())
        assert fast == regular
    paths = (f"/instances/{MISSING}/step",) * 2
    fast, regular = await twin_answers(http, paths, b'{"action": "Up"}')
    assert fast == regular and fast[0] == 404
    bandits = await twins(http, BANDIT)
    for _ in range(2):  # a pull ends the episode; the next step is a 409 on both paths
        paths = (f"/instances/{bandits[0]}/step", f"/instances/{bandits[1]}/step")
        fast, regular = await twin_answers(http, paths, b'{"action": "Dragon"}')
        assert fast == regular
    assert fast[0] == 409
    for body in (b'{"action": "Up", "extra": 1}', b'{"action": 3}', b'{"act', b"", b"[]"):
        response = await http.post(f"/instances/{ids[0]}/step", content=body, headers={"content-type": FAST})
        assert response.status_code == 422 and response.json()["error"]["code"] == "validation_error"


async def test_reset_fast_path_answers_as_the_regular_handler(http: httpx.AsyncClient) -> None:
    ids = await twins(http)
    paths = (f"/instances/{ids[0]}/reset", f"/instances/{ids[1]}/reset")
    for body in (b'{"seed": 9}', b'{"seed": 9, "options": {"size": 6}}', b"{}", b'{"options": {"size": 3}}'):
        fast, regular = await twin_answers(http, paths, body)
        assert fast == regular and fast[0] == 200
    no_body = [await http.post(path) for path in paths]
    assert no_body[0].content == no_body[1].content and no_body[0].status_code == 200
    for body in (b'{"seed": -1}', b'{"seed": 1.5}', b'{"options": {"size": 99}}', b'{"other": 1}', b"[]"):
        fast, regular = await twin_answers(http, paths, body)
        assert fast == regular and fast[0] == 422
    for body in (b'{"seed": 2.0}', b"null"):  # odd but valid to FastAPI: the regular handler takes them
        fast, regular = await twin_answers(http, paths, body)
        assert fast == regular and fast[0] == 200
    fast, regular = await twin_answers(http, (f"/instances/{MISSING}/reset",) * 2, b'{"seed": 1}')
    assert fast == regular and fast[0] == 404


async def test_batch_fast_path_answers_as_the_regular_handler(http: httpx.AsyncClient) -> None:
    first, second = await twins(http), await twins(http)  # [a, a'], [b, b']: a twin of a', b of b'
    for actions in (["Down", "Right"], ["nope", "Down"], ["Down", "Down"]):
        bodies = [
            orjson.dumps(
                {"steps": [{"instance_id": i, "action": a} for i, a in zip(ids, actions, strict=True)]}
            )
            for ids in ((first[0], second[0]), (first[1], second[1]))
        ]
        answers = []
        for body, content_type in zip(bodies, (FAST, REGULAR), strict=True):
            response = await http.post(
                "/instances/step", content=body, headers={"content-type": content_type}
            )
            assert response.status_code == 200
            results = response.json()["results"]
            for result in results:
                result["instance_id"] = None
                if result["error"]:
                    result["error"]["message"] = result["error"]["message"].split()[0]  # names the id
            answers.append(results)
        assert answers[0] == answers[1]
    mixed = {"steps": [{"instance_id": MISSING, "action": "Up"}]}
    fast, regular = await twin_answers(http, ("/instances/step",) * 2, orjson.dumps(mixed))
    assert fast == regular and fast[0] == 200
    too_many = {"steps": [{"instance_id": MISSING, "action": "Up"}] * 4097}
    fast, regular = await twin_answers(http, ("/instances/step",) * 2, orjson.dumps(too_many))
    assert fast == regular and fast[0] == 422


# ---------------------------------------------------------------- connections and retries


async def test_connection_refused_retries_then_raises() -> None:
    port = free_port()  # nothing listens here
    async with EnvClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as client:
        started = time.monotonic()
        with pytest.raises(EnvConnectionError) as raised:
            await client.create(FROZENLAKE)
    assert "cannot connect" in str(raised.value)
    assert "gave up after 3 tries" in str(raised.value)
    assert time.monotonic() - started < 5


async def test_no_retries_means_one_try() -> None:
    async with EnvClient(f"http://127.0.0.1:{free_port()}", retries=0) as client:
        with pytest.raises(EnvConnectionError, match="gave up after 1 try"):
            await client.health()


async def test_retries_reach_a_server_that_comes_up_late(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with EnvClient(url, retries=200, backoff_s=0.05, max_backoff_s=0.2) as client:
        pending = asyncio.create_task(client.create(BANDIT, seed=4))
        await asyncio.sleep(0.3)
        assert not pending.done()  # still retrying: nothing listens yet
        server = await asyncio.to_thread(
            start_server,
            ["env", "serve", "--env", "env_server.envs.game.bandit:BanditEnv", "--port", str(port)],
            port,
            tmp_path,
            None,
            "late",
        )
        try:
            created = await asyncio.wait_for(pending, timeout=60)
            assert isinstance(created, InstanceCreated)
            assert (await client.get(created.instance_id)).seed == 4
        finally:
            stop_server(server.process)


async def test_token_is_sent_when_configured(tmp_path: Path) -> None:
    port = free_port()
    server = await asyncio.to_thread(
        start_server,
        ["env", "serve", "--env", "env_server.envs.game.bandit:BanditEnv", "--port", str(port)],
        port,
        tmp_path,
        {"STARGYM_API_TOKEN": "s3cret"},
        "token",
    )
    try:
        async with EnvClient(server.url, token="s3cret") as client:
            created = await client.create(BANDIT, seed=1)
            assert (await client.get(created.instance_id)).env == BANDIT
        for token in (None, "wrong"):
            async with EnvClient(server.url, token=token) as client:
                assert (await client.health()).status == "ok"  # /health needs no token
                with pytest.raises(EnvServerError) as raised:
                    await client.list_envs()
                assert (raised.value.status, raised.value.code) == (401, "unauthorized")
    finally:
        stop_server(server.process)


# ------------------------------------------------- fake servers that misbehave on purpose


async def fake_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]):
    """A raw TCP server on a free port; returns it with a list that counts its connections."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await reader.readuntil(b"\r\n\r\n")  # the request's head: it did reach the server
            await handle(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the request, then close without answering."""


async def test_step_that_reached_the_server_is_not_resent() -> None:
    server, url, connections = await fake_server(hang_up)
    async with server, EnvClient(url, retries=3, backoff_s=0.01) as client:
        with pytest.raises(EnvConnectionError, match="not re-sent"):
            await client.step("some-id", "Up")
        assert len(connections) == 1
        with pytest.raises(EnvConnectionError, match="gave up after 4 tries"):
            await client.get("some-id")  # a read is safe to repeat
        assert len(connections) == 5
        with pytest.raises(EnvConnectionError, match="not re-sent"):
            await client.close("some-id")  # a second DELETE could answer 404 for a close that worked
        assert len(connections) == 6


async def test_read_timeout_is_not_retried() -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    server, url, connections = await fake_server(never_answer)
    async with server, EnvClient(url, timeout=0.3, retries=3) as client:
        with pytest.raises(EnvTimeoutError, match="not re-sent"):
            await client.step("some-id", "Up")
    assert len(connections) == 1


async def test_error_without_our_json_body_keeps_status_and_text() -> None:
    async def bad_gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b"<html>upstream down</html>"
        writer.write(
            b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        await writer.drain()

    server, url, _ = await fake_server(bad_gateway)
    async with server, EnvClient(url) as client:
        with pytest.raises(EnvServerError) as raised:
            await client.step("some-id", "Up")
    assert (raised.value.status, raised.value.code) == (502, "http_error")
    assert "upstream down" in raised.value.message


async def test_client_must_be_opened() -> None:
    client = EnvClient("http://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="async with"):
        await client.health()


async def test_max_connections_bounds_requests_in_flight() -> None:
    in_flight = {"now": 0, "most": 0}

    async def answer_slowly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            in_flight["now"] += 1
            in_flight["most"] = max(in_flight["most"], in_flight["now"])
            await asyncio.sleep(0.02)
            in_flight["now"] -= 1
            body = b'{"observation": "o", "reward": 0.0, "done": false, "info": {}}'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            )
            writer.write(body)
            await writer.drain()
            try:  # keep-alive: the next request on this connection, until the client hangs up
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(len(b'{"action":"Up"}'))
            except (asyncio.IncompleteReadError, ConnectionError):
                return

    async def first_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(b'{"action":"Up"}'))
        await answer_slowly(reader, writer)

    server, url, connections = await fake_server(first_body)
    async with server, EnvClient(url, max_connections=2) as client:
        results = await asyncio.gather(*(client.step("some-id", "Up") for _ in range(10)))
    assert all(result.observation == "o" for result in results)
    assert in_flight["most"] == 2
    assert len(connections) == 2  # and the two connections were kept alive and reused
