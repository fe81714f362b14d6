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

Whichever pass runs, only the logits that predict a trainable token are computed: the LM head
runs on those columns alone (``logits_to_keep``), and the caller gets them as one ``[N, V]``
tensor, what :func:`trainer.algorithms.selected_logprobs_and_entropy` takes.
"""

from __future__ import annotations

import functools
import inspect

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

    ``start`` is 0 (one ordinary pass) unless the rows' shared context is worth computing once:
    at least :data:`MIN_SHARED_TOKENS` long and at most half as many distinct prompts as rows.
    ``share_prompts`` False always makes one pass (FSDP: every rank must run the same passes).
    Rows are right-padded (``attention_mask`` 1 on a prefix of each row).
    """
    predicting = response_mask[:, 1:].bool()  # token t is predicted by the logits of column t - 1
    columns = predicting.any(dim=0).nonzero().squeeze(1)
    start = shared_length(response_mask) if share_prompts else 0
    logits = None
    if start >= MIN_SHARED_TOKENS:
        prompts, inverse = torch.unique(input_ids[:, :start], dim=0, return_inverse=True)
        if 2 * prompts.shape[0] <= input_ids.shape[0]:
            logits = _logits_after_shared_prompts(
                module, input_ids, attention_mask, prompts, inverse, columns - start
            )
    if logits is None:
        start = 0
        logits = _logits_at(module, columns, input_ids=input_ids, attention_mask=attention_mask)
    slot = torch.zeros(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    slot[columns] = torch.arange(columns.numel(), device=input_ids.device)
    rows, cols = predicting.nonzero(as_tuple=True)
    return logits[rows, slot[cols]], start


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


def _logits_after_shared_prompts(
    module: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompts: torch.Tensor,
    inverse: torch.Tensor,
    columns: torch.Tensor,
) -> torch.Tensor:
    """Forward the distinct ``prompts`` ``[U, C]`` once, then every row's tokens after them on the
    KV of its own (row ``i``'s prompt is ``prompts[inverse[i]]``); the logits of ``columns``
    (counted from ``C``)."""
    start = prompts.shape[1]
    prompt_cache = DynamicCache()
    no_columns = columns[:0]
    _logits_at(module, no_columns, input_ids=prompts, past_key_values=prompt_cache, use_cache=True)
    rows_cache = DynamicCache()
    for layer, kv in enumerate(prompt_cache.layers):
        rows_cache.update(kv.keys.index_select(0, inverse), kv.values.index_select(0, inverse), layer)
    positions = torch.arange(start, input_ids.shape[1], device=input_ids.device)
    return _logits_at(
        module,
        columns,
        input_ids=input_ids[:, start:],
        attention_mask=attention_mask,
        position_ids=positions.unsqueeze(0).expand(input_ids.shape[0], -1),
        past_key_values=rows_cache,
        use_cache=True,
    )
