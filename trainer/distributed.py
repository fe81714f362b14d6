"""Data-parallel wrapping of the trained modules and the collectives the update needs.

Under ``torch.distributed`` with ``world_size > 1`` each trained module is sharded with FSDP2
(``torch.distributed.fsdp.fully_shard`` on every decoder layer, then the root) or replicated with
DDP. Both run on CPU with gloo and on GPUs with NCCL under ``torchrun``. Everything that differs
between the three cases (single process, DDP, FSDP) lives here, so the update reads the same in
all of them: :meth:`Parallelism.wrap`, the gradient-sync switch for micro-batch accumulation,
sum all-reduces that are no-ops in one process, and full (unsharded) state dicts of models and
optimizers for checkpoints. The state-dict methods are collectives under FSDP: call them on
every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

Parallel = Literal["fsdp", "ddp"]


@dataclass(frozen=True)
class Parallelism:
    """How this process takes part in training: ``mode`` None in a single process.

    device: where this rank's modules live (DDP pins CUDA modules to its index).
    """

    mode: Parallel | None
    world_size: int
    rank: int
    device: torch.device

    @classmethod
    def current(cls, parallel: Parallel, device: torch.device) -> Parallelism:
        """``parallel`` when ``torch.distributed`` is initialised with more than one rank, else
        single-process (``mode`` None, world size 1, rank 0)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(parallel, dist.get_world_size(), dist.get_rank(), device)
        return cls(None, 1, 0, device)

    @property
    def distributed(self) -> bool:
        return self.mode is not None

    @property
    def forwards_may_differ(self) -> bool:
        """Whether ranks may run different numbers of forward passes: not under FSDP, where every
        forward gathers parameters with collectives that all ranks must join (a rank that split
        its micro-batch in two passes aborted its peer with a gloo size mismatch)."""
        return self.mode != "fsdp"

    # -- wrapping --

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` ready for data-parallel training (itself in a single process).

        FSDP shards each submodule whose class is named in a ``_no_split_modules`` list of
        ``module`` or of any submodule (Hugging Face's decoder layers), then the root, so
        parameters are gathered one layer at a time.
        """
        if self.mode is None:
            return module
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)
        from torch.distributed.fsdp import fully_shard

        layer_names = {
            name for sub in module.modules() for name in (getattr(sub, "_no_split_modules", None) or [])
        }
        for sub in list(module.modules()):
            if sub is not module and type(sub).__name__ in layer_names:
                fully_shard(sub)
        fully_shard(module)
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module inside a DDP wrapper (under FSDP the module itself, its parameters shards)."""
        return getattr(module, "module", module) if self.mode == "ddp" else module

    # -- collectives --

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        """``tensor`` reduced in place over ranks (``op`` default SUM); unchanged in one process."""
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    @contextlib.contextmanager
    def grad_sync(self, module: nn.Module, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce (DDP) / reduce-scatter (FSDP) unless ``sync``: accumulate
        locally over the micro-batches and synchronise on the last one."""
        if self.mode == "ddp" and not sync:
            with module.no_sync():  # type: ignore[operator]
                yield
            return
        if self.mode == "fsdp":
            module.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield

    # -- full state dicts --

    def full_model_state(self, module: nn.Module, rank0_only: bool) -> dict[str, Any]:
        """The unsharded state dict; under FSDP with ``rank0_only`` only rank 0 gets it (on CPU)."""
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
            return get_model_state_dict(module, options=options)
        return self.unwrap(module).state_dict()

    def set_full_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Load an unsharded state dict (every rank passes the full one)."""
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))
            return
        self.unwrap(module).load_state_dict(state)

    def full_optim_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state with unsharded tensors (on CPU under FSDP)."""
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(module, optimizer, options=options)
        return optimizer.state_dict()

    def set_full_optim_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Inverse of :meth:`full_optim_state`."""
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
            return
        optimizer.load_state_dict(state)
