"""Wait until a URL answers 2xx or a file exists, then exit 0; past the deadline exit 1 saying why.

Run by init containers (mounted from the ``stargym-wait-for`` ConfigMap, run with the stargym
image's Python, standard library only). Kubernetes orders the containers of one pod, not pods: the
rollout worker asks its engine for the model directory when it starts, and the CPU engine needs
the model the trainer writes first. Without a wait, those containers exit and back off for up to
five minutes between tries (CrashLoopBackOff); polling here starts them within seconds of what
they need being there. At the deadline the reason is in the init container's log and the kubelet
runs it again, so a dependency that never comes is visible instead of silent.

    python wait_for.py --url http://vllm:8000/health --timeout 1800
    python wait_for.py --file /data/models/tiny-frozenlake/config.json
"""

from __future__ import annotations

import argparse
import http.client
import sys
import time
import urllib.request
from pathlib import Path

REQUEST_TIMEOUT_S = 5.0


def not_ready(url: str | None, file: Path | None) -> str | None:
    """None when the target is there; otherwise why it is not."""
    if file is not None:
        return None if file.is_file() else f"{file} does not exist yet"
    assert url is not None
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
            return None if 200 <= response.status < 300 else f"{url} answered {response.status}"
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, DNS, timeout, 4xx/5xx
        return f"{url}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="Wait until a GET of this URL answers 2xx.")
    target.add_argument("--file", type=Path, help="Wait until this file exists.")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Give up after this many seconds.")
    parser.add_argument("--interval", type=float, default=2.0, help="Seconds between tries.")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    last = None
    while (reason := not_ready(args.url, args.file)) is not None:
        if reason != last:  # the log says what it waits for, once per new reason
            print(f"waiting: {reason}", flush=True)
            last = reason
        if time.monotonic() >= deadline:
            print(f"gave up after {args.timeout:.0f} s: {reason}", file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)
    print(f"ready: {args.url or args.file}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
