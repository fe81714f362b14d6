"""``python -m deploy.healthcheck URL``: exit 0 when ``GET URL`` answers 200, else 1 with the reason.

The containers' health check (docker-compose.yml): the images carry no curl, and this imports nothing
but the standard library, so a probe every few seconds costs ~30 ms of one core rather than the
~1 s that importing the ``stargym`` CLI (torch) would.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def check(url: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """None when ``url`` answers 200; otherwise what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m deploy.healthcheck URL", file=sys.stderr)
        return 2
    problem = check(argv[0])
    if problem is None:
        return 0
    print(f"{argv[0]}: {problem}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
