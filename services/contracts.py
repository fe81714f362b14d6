"""Cross-service contracts that are not wire models: the one definition every service imports.

* :data:`ACTION_SEPARATOR`: how one reply carries several actions (``Left || Up``); the rollout
  worker writes it, the env host splits on it.
* :data:`FAMILY_PORTS` and the services' default ports (docs/architecture.md, "Names and ports").
* :func:`parse_family_urls`: the ``family=URL`` lists that name env servers, as the worker's
  ``--env``, ``stargym eval --env-url`` and ``STARGYM_ROLLOUT_ENV_URLS`` take them.
"""

from __future__ import annotations

ACTION_SEPARATOR = "||"
"""Between the actions of one reply, when an env allows several per turn."""

FAMILY_PORTS: dict[str, int] = {"game": 8101, "embodied": 8102, "search": 8103, "web": 8104}
"""Default env server port of each env family."""
ROLLOUT_PORT = 8200
ENGINE_PORT = 8210
TRAINER_PORT = 8300


def parse_family_urls(value: str | list[str] | dict[str, str]) -> dict[str, str]:
    """``'game=http://127.0.0.1:8101,search=http://…'`` (or ``['game=…', …]``, or a dict) → family → URL.

    Raises ValueError, saying what is wrong, for an item that is not ``FAMILY=URL``, a URL that is
    not http(s), an env id where a family belongs (``game/sokoban``), a family named twice, or none.
    """
    if isinstance(value, dict):
        pairs = list(value.items())
    else:
        items = value.split(",") if isinstance(value, str) else [i for v in value for i in v.split(",")]
        pairs = []
        for item in (item.strip() for item in items):
            if not item:
                continue
            family, sep, url = item.partition("=")
            if not sep or not family.strip() or not url.strip():
                raise ValueError(f"env server {item!r} must be FAMILY=URL, e.g. game=http://127.0.0.1:8101")
            pairs.append((family, url))
    urls: dict[str, str] = {}
    for family, url in pairs:
        family, url = family.strip(), url.strip().rstrip("/")
        if "/" in family:
            raise ValueError(f"{family!r} is an env id; name the family (the part before '/')")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"env server {family}={url!r}: the URL must start with http:// or https://")
        if family in urls:
            raise ValueError(f"env family {family!r} is given twice")
        urls[family] = url
    if not urls:
        raise ValueError("at least one env server is needed")
    return urls
