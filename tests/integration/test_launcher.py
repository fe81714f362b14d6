"""``deploy.launcher.start_service``: a real service started below this process's CPU priority.

``stargym up`` runs the env servers, the engine and the rollout worker ``nice``-d below the trainer
(``deploy.up.ROLLOUT_NICENESS``); the priority must hold for every thread the service makes, not
only for the one that started it, or the engine's torch threads would compete at full weight.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy.launcher import free_port, start_service

pytestmark = pytest.mark.timeout(120)


def thread_priorities(pid: int) -> set[int]:
    """The nice value of every thread of ``pid`` (Linux: each thread has its own)."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("niceness", [0, 3])
def test_a_service_and_all_its_threads_run_niceness_steps_below_the_launcher(
    tmp_path: Path, niceness: int
) -> None:
    port = free_port()
    service = start_service(
        "env-game", ["env", "serve", "game", "--port", str(port)], port, tmp_path, niceness=niceness
    )
    try:
        assert len(os.listdir(f"/proc/{service.process.pid}/task")) > 1  # threads made after the start
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert thread_priorities(service.process.pid) == {min(19, own + niceness)}
    finally:
        service.stop()
