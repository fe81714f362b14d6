"""``stargym dashboard RUNS_DIR`` over HTTP: the JSON API the pages read, its errors, and its token guard."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RunningServer, free_port, start_server, stop_server
from dashboard_data import SCRIPT, make_run

TOKEN = "api-test-token"


def serve(runs_dir: Path, log_dir: Path, token: str | None = None) -> RunningServer:
    port = free_port()
    env = {"REDIS_URL": ""} | ({"STARGYM_API_TOKEN": token} if token else {})  # no system view
    return start_server(
        ["dashboard", str(runs_dir), "--port", str(port)], port, log_dir, env=env, name="dashboard"
    )


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("dashboard")
    make_run(root / "runs", "long", steps=3000)
    make_run(root / "runs", "short", steps=5)
    make_run(root, "outside", steps=1)  # beside the runs directory, never served
    server = serve(root / "runs", root / "logs")
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        yield client
    stop_server(server.process)


def raw_get(base_url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` exactly as written: HTTP clients (httpx, browsers) resolve ``..`` before sending."""
    url = httpx.URL(base_url)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=10.0)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def error_code(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["code"]


def test_runs_list_and_config(dashboard: httpx.Client) -> None:
    body = dashboard.get("/api/runs").json()
    assert body["live_run"] is None
    assert {run["name"] for run in body["runs"]} == {"long", "short"}
    run = next(run for run in body["runs"] if run["name"] == "long")
    assert run["status"] == "done" and run["step"] == 3000 and run["last_success"] == 1.0
    assert "horizon_schedule" in dashboard.get("/api/runs/long/config").json()["yaml"]


def test_metrics_are_downsampled_and_followed_by_cursor(dashboard: httpx.Client) -> None:
    body = dashboard.get(
        "/api/runs/long/metrics", params={"keys": "rollout/*,env/*/success", "max_points": 100}
    )
    series = body.json()["series"]
    assert set(series) == {"rollout/success", "rollout/reward_mean", "env/game/bandit/success"}
    success = series["rollout/success"]
    assert success["downsampled"] and len(success["step"]) == 100 and success["step"][-1] == 3000
    assert success["value"][-1] == 1.0
    cursor = body.json()["cursor"]
    assert cursor == 3000
    after = dashboard.get("/api/runs/long/metrics", params={"keys": "rollout/success", "after": cursor - 2})
    assert after.json()["series"]["rollout/success"]["step"] == [2999, 3000]
    assert (
        error_code(dashboard.get("/api/runs/long/metrics", params={"max_points": 1}), 422)
        == "validation_error"
    )


def test_events_trajectories_and_groups(dashboard: httpx.Client) -> None:
    assert [stage["step"] for stage in dashboard.get("/api/runs/short/events").json()["stages"]] == [0, 5]
    listed = dashboard.get("/api/runs/short/trajectories", params={"status": "kept"}).json()
    assert listed["total"] == 2 and listed["envs"] == ["game/bandit"]
    assert {t["job_id"] for t in listed["trajectories"]} == {"g1-0", "g1-1"}
    one = dashboard.get("/api/runs/short/trajectories/g2-0").json()
    assert one["turns"][0]["observation"] == SCRIPT  # JSON carries the text as it is; the page escapes it
    tokens = one["tokens"]
    assert tokens["mask"] == [0, 0, 0, 1, 1] and tokens["text"] == ["#1", "#10", "#11", "#12", "#2"]
    assert tokens["advantages"] is None and tokens["logprobs"][3] == -0.25
    download = dashboard.get("/api/runs/short/trajectories/g1-0", params={"download": 1})
    assert download.headers["content-disposition"] == 'attachment; filename="trajectory-g1-0.json"'
    assert download.json()["tokens"]["advantages"] == [0, 0, 0, 0.5, 0.5]
    group = dashboard.get("/api/runs/short/groups/g2").json()
    assert group["status"] == "filtered" and [t["replies"] for t in group["trajectories"]] == [["Dragon"]] * 2


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs/nope/metrics",
        "/api/runs/outside/config",
        "/api/runs/../config",
        "/api/runs/%2e%2e/config",
        "/api/runs/..%2foutside/config",
        "/api/runs/short/trajectories/nope",
        "/api/runs/short/groups/nope",
    ],
)
def test_unknown_and_escaping_paths_are_404(dashboard: httpx.Client, path: str) -> None:
    status, body = raw_get(str(dashboard.base_url), path)
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found", body


def test_static_files_cannot_escape_their_directory(dashboard: httpx.Client) -> None:
    assert dashboard.get("/static/dashboard.js").status_code == 200
    assert dashboard.get("/static/vendor/plotly.min.js").headers["content-type"].startswith("text/javascript")
    for path in ("/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py"):
        assert raw_get(str(dashboard.base_url), path)[0] == 404, path


def test_the_token_guards_everything_and_a_browser_signs_in_once(tmp_path: Path) -> None:
    make_run(tmp_path / "runs", "a", steps=2)
    server = serve(tmp_path / "runs", tmp_path / "logs", token=TOKEN)
    try:
        with httpx.Client(base_url=server.url, timeout=10.0) as client:
            assert client.get("/health").status_code == 200
            for path in ("/", "/api/runs", "/api/runs/a/trajectories", "/static/dashboard.js", "/api/system"):
                assert error_code(client.get(path), 401) == "unauthorized", path
            assert error_code(client.get("/api/runs", params={"token": "wrong"}), 401) == "unauthorized"
            page = client.get("/", headers={"Accept": "text/html"})
            assert page.status_code == 401 and 'action="/login"' in page.text
            assert client.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200

            wrong = client.post("/login", data={"token": "wrong"})
            assert (
                wrong.status_code == 401
                and "Wrong token" in wrong.text
                and "stargym_token" not in wrong.headers.get("set-cookie", "")
            )
            signed_in = client.post("/login", data={"token": TOKEN})
            assert signed_in.status_code == 303 and signed_in.headers["location"] == "/"
            cookie = signed_in.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            assert client.get("/api/runs").status_code == 200  # the client keeps the cookie

        with httpx.Client(base_url=server.url, timeout=10.0) as fresh:
            link = fresh.get("/api/runs/a/metrics", params={"token": TOKEN, "keys": "rollout/success"})
            assert (
                link.status_code == 303
                and link.headers["location"] == "/api/runs/a/metrics?keys=rollout%2Fsuccess"
            )
            assert fresh.get(link.headers["location"]).json()["series"]["rollout/success"]["step"] == [1, 2]
    finally:
        stop_server(server.process)


def test_system_view_without_redis_says_why(dashboard: httpx.Client) -> None:
    body = dashboard.get("/api/system").json()
    assert body == {
        "available": False,
        "reason": "no Redis URL was given (stargym dashboard --redis-url URL)",
    }
