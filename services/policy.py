"""Policy weights on disk: Hugging Face layout with safetensors, versioned as ``policy-v<N>/``.

The trainer writes checkpoints and rollout engines read them, so both go through this module:
one definition of the directory name, one atomic save, one way to load a state dict into a model
that is already serving. Any local Hugging Face causal-LM directory loads the same way as the tiny
default, which is what lets a real model replace it without code changes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

POLICY_PREFIX = "policy-v"
_POLICY_NAME = re.compile(r"^policy-v(\d+)$")
SAFETENSORS_INDEX = "model.safetensors.index.json"


class PolicyLoadError(ValueError):
    """A directory that holds no loadable weights, or weights that do not fit the model."""


def policy_dir_name(version: int) -> str:
    """``policy-v<N>``: the one spelling trainer, workers and Redis agree on."""
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    return f"{POLICY_PREFIX}{version}"


def policy_version(path: str | Path) -> int | None:
    """The ``N`` of a ``.../policy-v<N>`` directory, or None for any other name."""
    match = _POLICY_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def latest_policy(checkpoint_dir: str | Path) -> tuple[int, Path] | None:
    """The highest complete ``policy-v<N>`` under ``checkpoint_dir`` (temp dirs never match)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    found = [(version, child) for child in root.iterdir() if (version := policy_version(child)) is not None]
    return max(found) if found else None


def save_policy(model: PreTrainedModel, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write model (safetensors) and tokenizer to ``out_dir`` so readers never see half a checkpoint.

    Everything is written to a temp dir beside ``out_dir`` (same filesystem, so the rename is
    atomic) and renamed into place. An existing ``out_dir`` is moved aside first and deleted
    after: a reader sees either the old or the new complete directory, or briefly none.
    """
    target = Path(out_dir).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _make_readable(staging)
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a private dir (0700): a checkpoint is read by other services, maybe other users."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _replace_dir(staging: Path, target: Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """Model and tokenizer of any local HF causal-LM directory, in eval mode, on CPU."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise PolicyLoadError(f"{str(directory)!r} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``path`` (single file or sharded with an index)."""
    directory = Path(path)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / shard for shard in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise PolicyLoadError(f"no .safetensors files in {str(directory)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


@torch.no_grad()
def load_weights_into(model: PreTrainedModel, path: str | Path) -> int:
    """Copy the checkpoint in ``path`` into ``model``'s parameters in place; returns tensors loaded.

    In place, so a serving engine keeps its model object (and anything holding references to its
    parameters). Every key must be known and every non-tied parameter present: a checkpoint of a
    different architecture is refused before anything is copied.
    """
    state = load_state_dict(path)
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise PolicyLoadError(f"checkpoint has keys the model lacks: {', '.join(unexpected[:5])}")
    shapes = [key for key, tensor in state.items() if tensor.shape != own[key].shape]
    if shapes:
        raise PolicyLoadError(f"checkpoint shapes differ from the model's for: {', '.join(shapes[:5])}")
    missing = [group[0] for group in _storage_groups(own) if not any(name in state for name in group)]
    if missing:
        raise PolicyLoadError(f"checkpoint lacks: {', '.join(sorted(missing)[:5])}")
    for key, tensor in state.items():
        own[key].copy_(tensor)
    return len(state)


def _storage_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Parameter names grouped by shared storage: tied weights are saved under one of their names."""
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(tensor.data_ptr(), []).append(name)
    return list(groups.values())
