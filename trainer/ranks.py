"""The trainer service as N processes: rank 0 leads, the other ranks follow its commands.

``stargym train CONFIG --nproc-per-node N`` (or a user's own ``torchrun``) starts N copies of the
trainer; :func:`init_distributed` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and joins the process
group (gloo on CPU, NCCL on GPUs). Rank 0 is the trainer service proper: the controller, Redis,
the HTTP API, checkpoints and published policies. The other ranks own nothing but their share of
the model; they run :func:`follow`, which waits for rank 0's commands and takes its part in each:

``batch``   rank 0 scatters the batch, whole groups per rank (GRPO's baselines are per group), and
            every rank runs ``PolicyUpdater.update`` on its share: gradients are averaged over
            ranks, so every rank ends the step with the same weights;
``publish`` / ``checkpoint``   the gathers that saving needs (``gathered_policy``,
            ``checkpoint_parts``: collectives under FSDP); only rank 0 writes;
``wait``    a heartbeat while rank 0 waits for rollouts, so that a follower's wait never reaches
            the process group's timeout;
``stop``    the run is over.

A rank that dies ends the job: torchrun stops the others, and under any other launcher the
survivors' next collective fails after ``timeout_s`` instead of hanging. A restart resumes every
rank from the newest checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

Command = Literal["batch", "publish", "checkpoint", "wait", "stop"]
DEFAULT_TIMEOUT_S = 600.0
"""How long a collective may wait for a dead peer; rank 0 sends a heartbeat every quarter of it."""
T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(
    device: str | None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[RankInfo, torch.device]:
    """Join the process group torchrun describes (if any) and pick this rank's device.

    Outside torchrun (no ``WORLD_SIZE``, or 1) nothing is initialised: one process, rank 0.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    info = RankInfo(int(os.environ.get("RANK", "0")), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    chosen = torch.device(
        f"cuda:{info.local_rank}" if cuda and info.distributed else device or ("cuda" if cuda else "cpu")
    )
    if info.distributed and not dist.is_initialized():
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        dist.init_process_group(
            backend="nccl" if chosen.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=chosen if chosen.type == "cuda" else None,
        )
        logger.info("rank %d of %d on %s", info.rank, info.world_size, chosen)
    return info, chosen


def leave_distributed() -> None:
    """Leave the process group before the interpreter shuts down (every rank, at its end).

    Without it, gloo's worker threads may still hold finished work whose tensors have Python
    references; destroying those during interpreter finalization takes the GIL and aborts the
    process (SIGABRT): CI saw a follower that had been told to stop die that way, which failed
    the whole torchrun job (pytorch/pytorch#179291 describes the crash).
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def split_groups(groups: Sequence[Sequence[T]], world_size: int) -> list[list[T]]:
    """Deal whole groups to ranks in turn: rank r gets groups r, r + N, r + 2N, ... (flattened)."""
    if len(groups) < world_size:
        raise ValueError(f"{len(groups)} groups cannot give each of {world_size} ranks at least one")
    return [[item for group in groups[rank::world_size] for item in group] for rank in range(world_size)]


class Leader:
    """Rank 0's side: send a command to every follower, scatter their shares of a batch."""

    def __init__(self, info: RankInfo, device: torch.device) -> None:
        self.info = info
        self.device = device

    def command(self, kind: Command) -> None:
        if self.info.distributed:
            dist.broadcast_object_list([kind], src=0, device=self._object_device)

    def scatter(self, shares: list[list[Any]]) -> list[Any]:
        """Send ``shares[r]`` to rank r; returns rank 0's own share."""
        if not self.info.distributed:
            return shares[0]
        received: list[Any] = [None]
        dist.scatter_object_list(received, shares, src=0)
        return received[0]

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


def follow(
    device: torch.device,
    update: Callable[[list[Any]], Any],
    publish: Callable[[], Any],
    checkpoint: Callable[[], Any],
) -> None:
    """A follower's loop: take part in each of rank 0's commands until ``stop``."""
    object_device = device if device.type == "cuda" else None
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, device=object_device)
        kind: Command = message[0]
        if kind == "stop":
            return
        if kind == "batch":
            share: list[Any] = [None]
            dist.scatter_object_list(share, None, src=0)
            update(share[0])
        elif kind == "publish":
            publish()
        elif kind == "checkpoint":
            checkpoint()
