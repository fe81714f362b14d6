"""The policy's forward pass over a batch whose episodes share their first prompt, computed once.

A GRPO group is ``group_size`` episodes from one initial state: every row of the group starts
with the same prompt (the env's instruction and first observation). In the FrozenLake demo that
is 125 of an episode's ~240 tokens, so 7 of every 8 rows recompute 125 tokens that their group's
first row already computed. This module runs the shared prompts once (one row per distinct
prompt), then the rest of every row on top of its prompt's KV: the same logits, and, since the
prompt's KV is part of the autograd graph, the same gradients. Measured on the demo's batch
(128 episodes, 30k tokens, one thread): forward + backward 1.75 s as one pass, 1.0 s shared.

The shared length ``C`` is one less than the shortest prompt in the micro-batch (the prompt ends
where the first trainable token starts; the token before it must be fed again, since its logits
predict that first sampled token): every row's first ``C`` tokens are context only. Rows are
deduplicated by those tokens, not by group id, so rows from different groups that happen to
share them share them too, and a group whose rows differ is never merged.

Before that, the prefix that *every* row shares (the env's instruction under the chat template,
``K`` of the ``C`` tokens) is computed once for the whole micro-batch. With a history window
(``rollout.history_turns: 0``) every turn is a row whose prompt is the instruction and one map:
the first 98 of its 127 tokens (the chat template and the instruction) are the same in every row.

Whichever pass runs, only the logits that predict a trainable token are computed: the LM head
runs on those columns alone (``logits_to_keep``), and the caller gets them as one ``[N, V]``
tensor, what :func:`trainer.algorithms.selected_logprobs_and_entropy` takes.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

MIN_SHARED_TOKENS = 16
"""Below this, the split's second pass costs more than the prompt tokens it saves."""


def shared_length(response_mask: torch.Tensor) -> int:
    """``C``: how many leading tokens are context in every row (0 when a row has no trainable token)."""
    trainable = response_mask.bool()
    if not bool(trainable.any(dim=1).all()):
        return 0
    return max(0, int(trainable.int().argmax(dim=1).min()) - 1)


def trainable_logits(
    module: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, int]:
    """``(token_logits, start)``: ``[N, V]``, the logits that predict the ``N`` trainable tokens
    (the ones of ``response_mask[:, 1:]``, row-major: the order of ``logits[:, :-1][mask]``).

    ``start`` is where the rows' own pass begins: 0 (one ordinary pass) unless a shared context is
    worth computing once, at least :data:`MIN_SHARED_TOKENS` long: the prefix every row has (``K``),
    and the distinct prompts (``C``) when there are at most half as many as rows.
    ``share_prompts`` False always makes one pass (FSDP: every rank must run the same passes).
    Rows are right-padded (``attention_mask`` 1 on a prefix of each row).
    """
    predicting = response_mask[:, 1:].bool()  # token t is predicted by the logits of column t - 1
    columns = predicting.any(dim=0).nonzero().squeeze(1)
    context = shared_length(response_mask) if share_prompts else 0
    plan = _sharing_plan(input_ids, context) if context >= MIN_SHARED_TOKENS else None
    if plan is None:
        start = 0
        logits = _logits_at(module, columns, input_ids=input_ids, attention_mask=attention_mask)
    else:
        start = plan.start
        logits = _logits_after_shared_context(module, input_ids, attention_mask, plan, columns - start)
    slot = torch.zeros(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    slot[columns] = torch.arange(columns.numel(), device=input_ids.device)
    rows, cols = predicting.nonzero(as_tuple=True)
    return logits[rows, slot[cols]], start


@dataclass(frozen=True)
class _SharingPlan:
    """What is computed once: ``common`` tokens of every row (0: none), then the distinct
    ``prompts`` ``[U, start]`` (None: none; row ``i``'s is ``prompts[inverse[i]]``). The rows'
    own pass starts at ``start``."""

    common: int
    prompts: torch.Tensor | None
    inverse: torch.Tensor | None

    @property
    def start(self) -> int:
        return self.common if self.prompts is None else int(self.prompts.shape[1])


def _sharing_plan(input_ids: torch.Tensor, context: int) -> _SharingPlan | None:
    """How the first ``context`` tokens of every row (context only) are best shared; None: not at all."""
    prompts, inverse = torch.unique(input_ids[:, :context], dim=0, return_inverse=True)
    distinct = 2 * prompts.shape[0] <= input_ids.shape[0]
    if prompts.shape[0] == 1:  # every row has the same context: it is the common prefix
        return _SharingPlan(context, None, None)
    differs = (input_ids[:, :context] != input_ids[:1, :context]).any(dim=0)
    common = int(differs.int().argmax())  # the first column where some row differs from row 0
    common = common if common >= MIN_SHARED_TOKENS else 0
    if distinct:
        return _SharingPlan(common, prompts, inverse)
    return _SharingPlan(common, None, None) if common else None


def _logits_at(module: nn.Module, columns: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    """``[B, K, V]``: the logits of the ``K`` sequence ``columns`` only.

    Most tokens of a multi-turn episode are observations, whose logits nothing uses: the model's
    own ``logits_to_keep`` applies its LM head (with whatever scaling or soft-capping it has) to
    the kept columns alone. Even with the tiny policy's 268-token vocabulary the demo's update
    went from 1.48-1.55x to 1.82-1.83x the bare loop's tokens/s (bench/trainer.py, runs
    alternating); with Qwen's 152k the full logits of that 30k-token batch would be 18 GB in fp32.
    """
    if _takes_logits_to_keep(type(getattr(module, "module", module))):  # DDP wraps the model
        return module(**inputs, logits_to_keep=columns).logits
    return module(**inputs).logits[:, columns]


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    """Whether the model's ``forward`` selects columns (transformers' causal LMs do; remote code may not)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _logits_after_shared_context(
    module: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    plan: _SharingPlan,
    columns: torch.Tensor,
) -> torch.Tensor:
    """Forward the common prefix once, the distinct prompts once each on its KV, then every row's
    tokens after ``plan.start`` on the KV of its own prompt; the logits of ``columns`` (counted
    from ``plan.start``)."""
    no_columns = columns[:0]
    cache, past = DynamicCache(), 0
    if plan.common:
        _logits_at(
            module, no_columns, input_ids=input_ids[:1, : plan.common], past_key_values=cache, use_cache=True
        )
        past = plan.common
    if plan.prompts is None:
        owners = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    else:
        distinct = plan.prompts.shape[0]
        if past:
            cache = _selected(cache, torch.zeros(distinct, dtype=torch.long, device=input_ids.device))
        _logits_at(
            module,
            no_columns,
            input_ids=plan.prompts[:, past:],
            position_ids=_positions(past, plan.start, distinct, input_ids.device),
            past_key_values=cache,
            use_cache=True,
        )
        owners, past = plan.inverse, plan.start
    return _logits_at(
        module,
        columns,
        input_ids=input_ids[:, past:],
        attention_mask=attention_mask,
        position_ids=_positions(past, input_ids.shape[1], input_ids.shape[0], input_ids.device),
        past_key_values=_selected(cache, owners),
        use_cache=True,
    )


def _selected(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """A cache whose row ``i`` is ``cache``'s row ``rows[i]`` (in the autograd graph: the shared
    rows' gradients add up, as if every row had computed them)."""
    selected = DynamicCache()
    for layer, kv in enumerate(cache.layers):
        selected.update(kv.keys.index_select(0, rows), kv.values.index_select(0, rows), layer)
    return selected


def _positions(start: int, end: int, rows: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, end, device=device).unsqueeze(0).expand(rows, -1)
