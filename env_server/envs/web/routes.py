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

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from env_server.envs.web.shop import ShopEnv
from env_server.envs.web.site import OPTION_PREFIX, page_at, render_watch
from env_server.pool import Instance, InstancePool
from env_server.routes import InstanceId, PoolDep
from services.errors import not_found
from services.openapi import error_responses

router = APIRouter(prefix="/shop/{instance_id:instance_id}", tags=["web: the shop's pages"])
NO_SESSION = error_responses(404, descriptions={404: "No web/shop instance of this id."})


def _session(pool: InstancePool, instance_id: str) -> tuple[Instance, ShopEnv]:
    instance = pool.get(instance_id)
    if not isinstance(instance.env, ShopEnv) or instance.env.goal is None:
        raise not_found("web/shop instance", instance_id)
    return instance, instance.env


def _base(instance_id: str) -> str:
    return f"/shop/{instance_id}/"


@router.get("/", response_class=HTMLResponse, summary="Watch the agent shop", responses=NO_SESSION)
async def watch(instance_id: InstanceId, pool: PoolDep) -> HTMLResponse:
    instance, env = _session(pool, instance_id)
    return HTMLResponse(render_watch(_base(instance_id), instance_id, env.page.path(), instance.turns))


@router.get("/live", summary="Where the agent is: its page, turns, actions and reward", responses=NO_SESSION)
async def live(instance_id: InstanceId, pool: PoolDep) -> dict[str, Any]:
    instance, env = _session(pool, instance_id)
    return {
        "path": env.page.path(),
        "turns": instance.turns,
        "done": instance.done,
        "reward": instance.total_reward,
        "history": [{"action": action, "valid": valid} for action, valid in env.history],
    }


@router.get(
    "/{page_path:path}",
    response_class=HTMLResponse,
    summary="A page of the shop",
    responses=error_responses(
        404,
        422,
        descriptions={
            404: "No web/shop instance of this id, or no page at this path.",
            422: f"A parameter is invalid: also an {OPTION_PREFIX}<name> the product has no such value of.",
        },
    ),
)
async def shop_page(
    instance_id: InstanceId,
    page_path: str,
    request: Request,
    pool: PoolDep,
    q: Annotated[str, Query(description="The search's keywords.")] = "",
    page: Annotated[int, Query(ge=1, description="The page of search results.")] = 1,
) -> HTMLResponse:
    """Also takes ``o.<name>=<value>`` for each option chosen on an item page. ``q`` and ``page``
    are declared for the document and validated here; :func:`page_at` reads them with the options."""
    _, env = _session(pool, instance_id)
    shown = page_at(page_path, request.query_params.multi_items(), env.data.catalog.products)
    return HTMLResponse(env.render(shown, _base(instance_id)))
