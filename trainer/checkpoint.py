"""Training checkpoints and published policies in the run directory.

The run directory (``run.output_dir``, default ``checkpoints/<run>/``), as a run writes it::

    <run_dir>/
        config.yaml             the run's resolved config (trainer/service.py, at every start)
        metrics.jsonl           one line per update, eval/* merged in (trainer/metrics.py)
        eval.jsonl              one line per held-out eval round (trainer/service.py)
        controller.jsonl        the controller's audit log, rotated as .1 ... .4 (trainer/controller.py)
        echo_trap.jsonl         echo-trap events, when there are any (trainer/service.py)
        trajectories.jsonl      the trajectories used, filtered or dropped, for the dashboard; rotated
                                as .1 ... .4 (trainer/dashboard/samples.py)
        status.json             the trainer's state, step and times (trainer/dashboard/runs.py)
        logs/                   one log per service started by `stargym up` (deploy/up.py)
        policy-v<N>/            a published policy the rollout side loads, after update N
                                (Hugging Face layout: config.json, generation_config.json,
                                model.safetensors, tokenizer files; services/policy.py);
                                the newest ``checkpoint.keep_policies`` are kept
        step-<N>/               the checkpoint after update N; the newest ``checkpoint.keep_last``
                                are kept; the newest complete one is where a run resumes

    step-<N>/
        policy/                 the policy's full weights, Hugging Face layout as above
        optimizer.pt            torch.save of the policy optimizer's full state (AdamW; gathered
                                from every rank under FSDP)
        scheduler.pt            torch.save of the LR scheduler's state
        critic.pt               the critic's model, optimizer and scheduler states (GAE only)
        rng.pt                  python, numpy, torch (and CUDA) RNG states
        state.json              written last: {"format", "step", "created_at", "curriculum":
                                {schedule, stage, max_turns}, "controller": {groups_issued,
                                counters}, "extra": {echo_trap, echo_counts, policy_version}}

The trainer passes ``PolicyUpdater.checkpoint_parts()`` as ``optimizer``, ``scheduler`` and
``critic``; the store itself writes whatever parts it is given and nothing else.

Every write is atomic: a checkpoint is written into ``.step-<N>.tmp-*`` beside its final place,
fsynced, and renamed to ``step-<N>``; a crash at any point leaves either the complete directory
or none, so :meth:`CheckpointStore.latest` never returns half a checkpoint. Temp dirs that a
crash left behind are removed when the next store is opened on the run directory. Only the
trainer (rank 0) writes here.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from services.policy import latest_policy, load_weights_into, policy_dir_name, policy_version, save_policy

STEP_PREFIX = "step-"
_STEP_NAME = re.compile(r"^step-(\d+)$")
_STRAY_NAME = re.compile(r"^\.(step-\d+|policy-v\d+)\.(tmp|old|del)-")
STATE_FILE = "state.json"
POLICY_SUBDIR = "policy"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
CRITIC_FILE = "critic.pt"
RNG_FILE = "rng.pt"
FORMAT_VERSION = 1


class HasState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


class CheckpointNotFound(FileNotFoundError):
    """No (complete) checkpoint of the asked step in the run directory."""


@dataclass
class LoadedCheckpoint:
    """What :meth:`CheckpointStore.load` restored, and the plain state the caller restores itself."""

    step: int
    path: Path
    policy_dir: Path
    curriculum_state: dict[str, Any] = field(default_factory=dict)
    controller_state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step}"


def step_of(path: str | Path) -> int | None:
    match = _STEP_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


# --- RNG states -------------------------------------------------------------------------------


def capture_rng_states() -> dict[str, Any]:
    """Python, numpy (legacy global) and torch RNG states, CUDA's too when CUDA is initialised."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    states: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(numpy_state["state"]["key"], dtype=np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_states`."""
    python = states["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = states["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy["bit_generator"],
            "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
            "has_gauss": numpy["has_gauss"],
            "gauss": numpy["gauss"],
        }
    )
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# --- the store --------------------------------------------------------------------------------


class CheckpointStore:
    """Saves, finds and restores ``step-<N>/`` checkpoints and publishes ``policy-v<N>/`` dirs.

    Opening a store removes the temp dirs an interrupted save or publish left in ``run_dir``
    (``read_only``: not, for the trainer's ranks other than 0, which only load: they must never
    delete a save rank 0 has in progress). ``keep_last`` complete checkpoints are kept (None:
    all); ``keep_policies`` published policies.
    """

    def __init__(
        self,
        run_dir: str | Path,
        keep_last: int | None = 3,
        keep_policies: int | None = 3,
        *,
        read_only: bool = False,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_policies is not None and keep_policies < 1:
            raise ValueError(f"keep_policies must be >= 1 or None, got {keep_policies}")
        # Absolute: published policy paths go to Redis for engines that may run elsewhere (another
        # container mounting the same volume), where a path relative to our working dir means nothing.
        self.run_dir = Path(run_dir).absolute()
        self.keep_last = keep_last
        self.keep_policies = keep_policies
        self.before_commit: Callable[[Path], None] | None = None
        """Test hook: called with the complete temp dir just before it is renamed into place."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.removed_strays = [] if read_only else self.clean_strays()

    # -- finding --

    def clean_strays(self) -> list[str]:
        """Delete temp dirs of interrupted saves/publishes; returns their names."""
        removed = []
        for child in self.run_dir.iterdir():
            if child.is_dir() and _STRAY_NAME.match(child.name):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
        return sorted(removed)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        found = []
        for child in self.run_dir.iterdir():
            step = step_of(child)
            if step is not None and (child / STATE_FILE).is_file():
                found.append(step)
        return sorted(found)

    def latest(self) -> int | None:
        """Step of the newest complete checkpoint, or None when there is none (a fresh run)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.run_dir / step_dir_name(step)

    # -- saving --

    def save(
        self,
        step: int,
        policy: Any,
        tokenizer: Any,
        *,
        optimizer: HasState | None = None,
        scheduler: HasState | None = None,
        critic: HasState | None = None,
        rng_states: dict[str, Any] | None = None,
        curriculum_state: dict[str, Any] | None = None,
        controller_state: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write ``step-<step>/`` atomically, then delete checkpoints beyond ``keep_last``.

        ``policy`` is a Hugging Face model (``save_pretrained``); with FSDP, pass the gathered
        full model and full optimizer state from rank 0. ``rng_states`` defaults to the current
        states (:func:`capture_rng_states`). The three dicts must be JSON-serialisable: that is
        checked before anything is written. An existing ``step-<step>/`` is replaced.
        """
        state = {
            "format": FORMAT_VERSION,
            "step": step,
            "created_at": time.time(),
            "curriculum": curriculum_state or {},
            "controller": controller_state or {},
            "extra": extra or {},
        }
        state_text = json.dumps(state, indent=1, allow_nan=False)  # fails early on non-JSON state
        target = self.step_dir(step)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=self.run_dir))
        try:
            save_policy(policy, tokenizer, staging / POLICY_SUBDIR)
            for name, obj in (
                (OPTIMIZER_FILE, optimizer),
                (SCHEDULER_FILE, scheduler),
                (CRITIC_FILE, critic),
            ):
                if obj is not None:
                    torch.save(obj.state_dict(), staging / name)
            torch.save(rng_states if rng_states is not None else capture_rng_states(), staging / RNG_FILE)
            (staging / STATE_FILE).write_text(state_text)
            _fsync_tree(staging)
            staging.chmod(0o755)
            if self.before_commit is not None:
                self.before_commit(staging)
            _install(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._prune_checkpoints()
        return target

    def publish_policy(self, version: int, policy: Any, tokenizer: Any) -> Path:
        """Write ``policy-v<version>/`` atomically and return its path, for ``services.queue.set_policy``.

        Older published versions beyond ``keep_policies`` are deleted (never the one just written).
        """
        target = save_policy(policy, tokenizer, self.run_dir / policy_dir_name(version))
        _fsync_tree(target)
        self._prune_policies(keep=version)
        return target

    def latest_policy(self) -> tuple[int, Path] | None:
        """The newest published ``(version, path)``, or None."""
        return latest_policy(self.run_dir)

    # -- loading --

    def load(
        self,
        step: int | Literal["latest"] = "latest",
        *,
        policy: Any | None = None,
        optimizer: HasState | None = None,
        scheduler: HasState | None = None,
        critic: HasState | None = None,
        restore_rng: bool = True,
        map_location: str | torch.device = "cpu",
    ) -> LoadedCheckpoint:
        """Restore a checkpoint into the given objects; return its step and plain state.

        ``policy``'s weights are replaced in place (``services.policy.load_weights_into``); without
        one, load ``result.policy_dir`` yourself (``services.policy.load_policy``). Objects given
        for parts the checkpoint lacks raise :class:`CheckpointNotFound`. Create the optimizer
        over the model's parameters before loading its state.
        """
        if step == "latest":
            latest = self.latest()
            if latest is None:
                raise CheckpointNotFound(f"no checkpoint in {str(self.run_dir)!r}")
            step = latest
        path = self.step_dir(step)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise CheckpointNotFound(f"no complete checkpoint of step {step} in {str(self.run_dir)!r}")
        state = json.loads(state_file.read_text())
        if policy is not None:
            load_weights_into(policy, path / POLICY_SUBDIR)
        for name, obj in ((OPTIMIZER_FILE, optimizer), (SCHEDULER_FILE, scheduler), (CRITIC_FILE, critic)):
            if obj is None:
                continue
            if not (path / name).is_file():
                raise CheckpointNotFound(f"checkpoint of step {step} has no {name}")
            obj.load_state_dict(torch.load(path / name, map_location=map_location, weights_only=True))
        if restore_rng:
            restore_rng_states(torch.load(path / RNG_FILE, map_location="cpu", weights_only=True))
        return LoadedCheckpoint(
            step=step,
            path=path,
            policy_dir=path / POLICY_SUBDIR,
            curriculum_state=state.get("curriculum", {}),
            controller_state=state.get("controller", {}),
            extra=state.get("extra", {}),
            created_at=state.get("created_at", 0.0),
        )

    # -- pruning --

    def _prune_checkpoints(self) -> None:
        if self.keep_last is None:
            return
        for step in self.steps()[: -self.keep_last]:
            _remove_dir(self.step_dir(step))

    def _prune_policies(self, keep: int) -> None:
        if self.keep_policies is None:
            return
        versions = sorted(
            version for child in self.run_dir.iterdir() if (version := policy_version(child)) is not None
        )
        for version in versions[: -self.keep_policies]:
            if version != keep:
                _remove_dir(self.run_dir / policy_dir_name(version))


def _install(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved aside first, then deleted."""
    if target.exists():
        _remove_dir(target)
    os.rename(staging, target)
    _fsync_dir(target.parent)


def _remove_dir(path: Path) -> None:
    """Rename out of the way first, so a crash mid-delete never leaves a half dir under its real name."""
    doomed = Path(tempfile.mkdtemp(prefix=f".{path.name}.del-", dir=path.parent))
    os.rename(path, doomed / path.name)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(directory))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
