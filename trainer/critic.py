"""The critic for GAE: the policy's backbone with a scalar value head.

Its values are aligned like the log-probs of :mod:`trainer.algorithms`: position ``t`` holds
V(state before token ``t`` is sampled). The state *after* a row's last real token (what a
truncated episode bootstraps from, docs/architecture.md "Training") has no such position, so the forward
pass returns it separately as ``final_values``.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn


class CriticOutput(NamedTuple):
    """values: ``[B, S]``, position ``t`` = ``head(hidden[:, t-1])``, position 0 = 0.
    final_values: ``[B]``, ``head(hidden)`` at each row's last real token (per ``attention_mask``):
    the value of the state the episode ended in."""

    values: torch.Tensor
    final_values: torch.Tensor


class ValueModel(nn.Module):
    """A critic of the policy's architecture: its backbone (``AutoModel``) and a linear value head
    initialised to zero (every value starts at 0, so the first advantages are the returns)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> ValueModel:
        """A copy of the policy's backbone (``policy.base_model``) with a zero-initialised head."""
        backbone = copy.deepcopy(policy.base_model)
        return cls(backbone, int(policy.config.hidden_size))

    @classmethod
    def from_pretrained(cls, path: str) -> ValueModel:
        """A backbone loaded from a Hugging Face model directory, with a zero-initialised head."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
        return cls(backbone, int(backbone.config.hidden_size))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> CriticOutput:
        """Values of every state of ``input_ids`` ``[B, S]`` (right-padded per ``attention_mask``)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = self.value_head(hidden).squeeze(-1).float()
        values = torch.cat([head.new_zeros(head.shape[0], 1), head[:, :-1]], dim=1)
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        final_values = head.gather(1, last.unsqueeze(1)).squeeze(1)
        return CriticOutput(values, final_values)
