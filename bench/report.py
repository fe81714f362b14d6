"""``make bench``: every benchmark, one after another, each in its own process, into ``bench/REPORT.md``.

Each benchmark prints its own tables, with its ratio against the baseline it ran in the same
process, and writes its numbers to ``bench/results/<name>.json``; this runs them with nothing
else on the machine and writes what they printed to the report, under the machine they ran on
and the command that regenerates it. One that fails is reported as failed (its output kept)
and the others still run; the command then exits 1.

    .venv/bin/python bench/report.py [--only load,trainer]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REPORT = REPO_ROOT / "bench" / "REPORT.md"
BENCHMARKS = {
    "env_server": "HTTP env server against stepping in-process (every family)",
    "engine": "CPU engine through HTTP against one generate() per request",
    "rollout": "the rollout worker against episodes driven in-process, and with the engine in its process",
    "trainer": "PolicyUpdater.update against a bare training loop",
    "dashboard": "dashboard page load at 10,000 steps, and training with the page open",
    "load": "env server under wrk (GC pauses), trajectories through Redis",
    "sandbox": "an env instance in a process of its own against the env in the server's process",
}
DEADLINE_S = 15 * 60
"""One benchmark that has not finished by then is stopped and reported as failed."""


def machine() -> str:
    """Cores, CPU model, memory and software: what the numbers depend on."""
    model = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kib = int(meminfo.read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB memory"
    import torch

    return (
        f"{os.cpu_count()} cores ({model}){memory}; {platform.platform()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def run(name: str) -> tuple[bool, float, str]:
    """``(passed, seconds, what it printed)`` for ``bench/<name>.py``."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "bench" / f"{name}.py")],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            env={**os.environ, "NO_COLOR": "1", "TERM": "dumb"},
        )
    except subprocess.TimeoutExpired as expired:
        printed = (
            (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        )
        return False, time.monotonic() - started, f"{printed}\nstopped after {DEADLINE_S} s"
    printed = done.stdout + (f"\n{done.stderr}" if done.returncode else "")
    return done.returncode == 0, time.monotonic() - started, printed.rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", type=lambda text: text.split(","), default=list(BENCHMARKS))
    args = parser.parse_args()
    unknown = set(args.only) - set(BENCHMARKS)
    if unknown:
        sys.exit(f"no such benchmark: {', '.join(sorted(unknown))} (there are: {', '.join(BENCHMARKS)})")
    started = time.monotonic()
    sections, failed = [], []
    for name in args.only:
        print(f"bench/{name}.py ...", file=sys.stderr, flush=True)
        passed, seconds, printed = run(name)
        print(printed, file=sys.stderr, flush=True)
        if not passed:
            failed.append(name)
        verdict = "" if passed else " — **FAILED**"
        sections.append(
            f"## {name}: {BENCHMARKS[name]}{verdict}\n\n`bench/{name}.py`, {seconds / 60:.1f} min; "
            f"numbers in `bench/results/{name}*.json`.\n\n```text\n{printed}\n```\n"
        )
    total = time.monotonic() - started
    command = (
        "make bench"
        if args.only == list(BENCHMARKS)
        else f"python bench/report.py --only {','.join(args.only)}"
    )
    header = (
        "# stargym benchmarks\n\n"
        f"Written by `{command}` on {datetime.date.today().isoformat()} in {total / 60:.1f} min, "
        f"on {machine()}.\nEvery ratio is against a baseline run in the same process, minutes apart at most, "
        "so it holds on another machine where the absolute numbers will not.\n\n"
    )
    REPORT.write_text(header + "\n".join(sections))
    print(f"wrote {REPORT.relative_to(REPO_ROOT)} ({total / 60:.1f} min)", file=sys.stderr)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
