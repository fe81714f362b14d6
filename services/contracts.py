"""Cross-service contracts that are not wire models: the one definition every service imports.

* :data:`ACTION_SEPARATOR`: how one reply carries several actions (``Left || Up``); the rollout
  worker writes it, the env host splits on it, both with :func:`split_actions`.
* :data:`FAMILY_PORTS` and the services' default ports (docs/architecture.md, "Names and ports").
* :func:`parse_env_servers`: the ``family=URL[,URL…]`` lists that name env servers, as the
  worker's ``--env`` and ``STARGYM_ROLLOUT_ENV_URLS`` take them (several servers per family), and
  :func:`parse_family_urls`, its one-server-per-family form (``stargym eval --env-url``).
"""

from __future__ import annotations

ACTION_SEPARATOR = "||"
"""Between the actions of one reply, when an env allows several per turn."""


def split_actions(text: str, max_actions: int) -> list[str]:
    """The non-empty :data:`ACTION_SEPARATOR`-separated parts of ``text``, stripped, at most
    ``max_actions`` of them: how the env host reads a reply and the worker reads an answer, so the
    two count the same actions."""
    if max_actions < 1:
        raise ValueError("max_actions must be >= 1")
    parts = (part.strip() for part in text.split(ACTION_SEPARATOR))
    return [part for part in parts if part][:max_actions]


FAMILY_PORTS: dict[str, int] = {
    "game": 8101,
    "embodied": 8102,
    "search": 8103,
    "web": 8104,
    "reasoning": 8105,
    "textarena": 8106,
}
"""Default env server port of each env family."""
ROLLOUT_PORT = 8200
ENGINE_PORT = 8210
TRAINER_PORT = 8300


def parse_env_servers(value: str | list[str] | dict[str, str | list[str]]) -> dict[str, list[str]]:
    """Family → the URLs of its env servers, from the ``--env`` / ``STARGYM_ROLLOUT_ENV_URLS`` syntax.

    ``'game=http://a:8101,http://b:8101;search=http://s:8103'``: items are separated by ``,`` or
    ``;``; ``FAMILY=URL`` starts a family and a bare ``http(s)://`` URL after it adds another
    server of that family (the older ``game=URL,search=URL`` form reads as before). A list (a
    repeated ``--env``) is parsed item by item, so a bare URL cannot continue another item's family;
    a dict maps each family to a URL or a list of them.

    Raises ValueError, saying what is wrong, for an item that is not ``FAMILY=URL`` or a URL after
    one, a URL that is not http(s), an env id where a family belongs (``game/sokoban``), a family
    named twice, a URL given twice for one family, or no server at all.
    """
    if isinstance(value, dict):
        groups = [(family, [urls] if isinstance(urls, str) else list(urls)) for family, urls in value.items()]
    else:
        groups = [group for text in ([value] if isinstance(value, str) else value) for group in _groups(text)]
    servers: dict[str, list[str]] = {}
    for family, urls in groups:
        family = family.strip()
        if "/" in family:
            raise ValueError(f"{family!r} is an env id; name the family (the part before '/')")
        if family in servers:
            raise ValueError(
                f"env family {family!r} is given twice; list all its servers once: {family}=URL1,URL2"
            )
        cleaned = [url.strip().rstrip("/") for url in urls]
        for url in cleaned:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"env server {family}={url!r}: the URL must start with http:// or https://")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"env family {family!r} names a server twice: {cleaned}")
        if not cleaned:
            raise ValueError(f"env family {family!r} has no server")
        servers[family] = cleaned
    if not servers:
        raise ValueError("at least one env server is needed")
    return servers


def _groups(text: str) -> list[tuple[str, list[str]]]:
    """``'game=URL,URL;search=URL'`` → ``[('game', [URL, URL]), ('search', [URL])]``, unchecked."""
    groups: list[tuple[str, list[str]]] = []
    for item in (item.strip() for item in text.replace(";", ",").split(",")):
        if not item:
            continue
        if item.startswith(("http://", "https://")):
            if not groups:
                example = "game=http://a:8101,http://b:8101"
                raise ValueError(f"env server {item!r} must follow FAMILY=URL, e.g. {example}")
            groups[-1][1].append(item)
            continue
        family, sep, url = item.partition("=")
        if not sep or not family.strip() or not url.strip():
            raise ValueError(f"env server {item!r} must be FAMILY=URL, e.g. game=http://127.0.0.1:8101")
        groups.append((family, [url]))
    return groups


def parse_family_urls(value: str | list[str] | dict[str, str]) -> dict[str, str]:
    """:func:`parse_env_servers` for the commands that take one env server per family
    (``stargym eval --env-url``): ``'game=http://127.0.0.1:8101,search=http://…'`` → family → URL.

    Raises ValueError as :func:`parse_env_servers` does, and for a family given several servers.
    """
    urls: dict[str, str] = {}
    for family, servers in parse_env_servers(value).items():
        if len(servers) > 1:
            raise ValueError(f"env family {family!r}: give one server here, not {len(servers)}")
        urls[family] = servers[0]
    return urls
