"""The shop as a web site: every page of every live session, and a page to watch an agent shop.

- ``GET /shop/<instance id>/``: the watch page, the agent's current page in a frame beside the
  actions it has taken, following the agent as it clicks (it polls ``live``).
- ``GET /shop/<instance id>/live``: ``{path, turns, done, reward, history}`` as JSON.
- ``GET /shop/<instance id>/<page>``: any page of the shop (:mod:`.site`'s URLs) for that
  session's goal. Pages are rendered from the URL, so browsing them leaves the agent's session
  as it is; ``buy/…`` shows what that purchase would score.

An unknown instance, an instance of another env, or a URL that names no page is a 404 (a bad
option or page number a 422) with the error contract's JSON body.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from env_server.envs.web.shop import ShopEnv
from env_server.envs.web.site import page_at, render_watch
from env_server.pool import Instance, InstancePool
from env_server.routes import PoolDep
from services.errors import not_found

router = APIRouter(prefix="/shop/{instance_id}", tags=["web: the shop's pages"])


def _session(pool: InstancePool, instance_id: str) -> tuple[Instance, ShopEnv]:
    instance = pool.get(instance_id)
    if not isinstance(instance.env, ShopEnv) or instance.env.goal is None:
        raise not_found("web/shop instance", instance_id)
    return instance, instance.env


def _base(instance_id: str) -> str:
    return f"/shop/{instance_id}/"


@router.get("/", response_class=HTMLResponse, summary="Watch the agent shop")
async def watch(instance_id: str, pool: PoolDep) -> HTMLResponse:
    instance, env = _session(pool, instance_id)
    return HTMLResponse(render_watch(_base(instance_id), instance_id, env.page.path(), instance.turns))


@router.get("/live", summary="Where the agent is: its page, turns, actions and reward")
async def live(instance_id: str, pool: PoolDep) -> dict[str, Any]:
    instance, env = _session(pool, instance_id)
    return {
        "path": env.page.path(),
        "turns": instance.turns,
        "done": instance.done,
        "reward": instance.total_reward,
        "history": [{"action": action, "valid": valid} for action, valid in env.history],
    }


@router.get("/{page_path:path}", response_class=HTMLResponse, summary="A page of the shop")
async def page(instance_id: str, page_path: str, request: Request, pool: PoolDep) -> HTMLResponse:
    _, env = _session(pool, instance_id)
    shown = page_at(page_path, request.query_params.multi_items(), env.data.catalog.products)
    return HTMLResponse(env.render(shown, _base(instance_id)))
