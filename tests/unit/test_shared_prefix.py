"""Shared prompts computed once give the logits and the gradients of one ordinary forward pass."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from deploy.tiny_model import build_model, build_tokenizer
from trainer.algorithms import predicting_logits
from trainer.shared_prefix import MIN_SHARED_TOKENS, shared_length, trainable_logits


def tiny_policy(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mistral":  # a sliding window (24) shorter than the rows
        config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, sliding_window=24)  # fmt: skip
        return MistralForCausalLM(config)
    return build_model(
        build_tokenizer(["You are walking on a frozen lake. P _ O G"], ["Left", "Right"]), seed=0
    )


def grouped_rows(
    vocab: int, groups: int, group_size: int, prompt_lengths: list[int], seed: int = 0, common: int = 0
):
    """Right-padded rows: each group's rows share a prompt, then replies (trainable) and observations.
    Every prompt starts with the same ``common`` tokens (an instruction) before its own."""
    rng = random.Random(seed)
    instruction = [rng.randrange(vocab) for _ in range(common)]
    rows, masks = [], []
    for group in range(groups):
        length = prompt_lengths[group % len(prompt_lengths)]
        prompt = instruction + [rng.randrange(vocab) for _ in range(length)]
        for _ in range(group_size):
            tokens, mask = list(prompt), [0.0] * len(prompt)
            for _ in range(rng.randrange(1, 4)):
                reply = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
                observation = [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))]
                tokens += reply + observation
                mask += [1.0] * len(reply) + [0.0] * len(observation)
            rows.append(tokens)
            masks.append(mask)
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    response = torch.tensor([mask + [0.0] * (width - len(mask)) for mask in masks])
    return input_ids, attention, response


class WithoutLogitsToKeep(torch.nn.Module):
    """A causal LM whose ``forward`` cannot select columns (as some remote-code models)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def trainable_logprobs(model, input_ids, attention, response, how: str):
    """Log-probs of the trainable tokens, and the gradient of their sum: from the full logits of
    one ordinary pass (the reference), or from :func:`trainable_logits`, one pass or shared."""
    model.zero_grad(set_to_none=True)
    if how == "full logits":
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        token_logits, start = predicting_logits(logits, response), 0
    else:
        token_logits, start = trainable_logits(
            model, input_ids, attention, response, share_prompts=how == "shared"
        )
    targets = input_ids[:, 1:][response[:, 1:].bool()]
    chosen = torch.log_softmax(token_logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    chosen.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return chosen.detach(), start, grads


@pytest.mark.parametrize("name", ["qwen", "mistral", "qwen without logits_to_keep"])
@pytest.mark.parametrize(
    ("groups", "group_size", "common", "shared_start"),
    [
        (4, 6, 0, 32),  # the distinct prompts once: the shortest prompt, less one
        (4, 6, 20, 52),  # the instruction once, then the distinct prompts once on it
        (12, 1, 20, 20),  # a prompt per row: only the instruction is shared
    ],
)
def test_trainable_logits_give_the_logprobs_and_gradients_of_full_logits(
    name: str, groups: int, group_size: int, common: int, shared_start: int
) -> None:
    model = tiny_policy(name.split()[0])
    vocab = model.config.vocab_size
    if name.endswith("logits_to_keep"):
        model = WithoutLogitsToKeep(model)
    input_ids, attention, response = grouped_rows(vocab, groups, group_size, [40, 33], common=common)
    full, _, full_grads = trainable_logprobs(model, input_ids, attention, response, "full logits")
    assert full.numel() == int(response[:, 1:].sum())
    for how, expected_start in (("one pass", 0), ("shared", shared_start)):
        chosen, start, grads = trainable_logprobs(model, input_ids, attention, response, how)
        assert start == expected_start
        assert chosen == pytest.approx(full, abs=1e-5)
        assert grads.keys() == full_grads.keys()
        for parameter, grad in full_grads.items():
            assert torch.allclose(grads[parameter], grad, atol=1e-5, rtol=1e-4), (how, parameter)


def test_a_micro_batch_with_nothing_trainable_still_backpropagates() -> None:
    """Zero logits, and a backward that reaches the parameters (DDP needs every rank's backward)."""
    model = tiny_policy("qwen")
    input_ids, attention, response = grouped_rows(model.config.vocab_size, 2, 3, [20])
    token_logits, _ = trainable_logits(model, input_ids, attention, torch.zeros_like(response))
    assert token_logits.shape == (0, model.config.vocab_size)
    token_logits.sum().backward()
    assert all(p.grad is not None for p in model.lm_head.parameters())


def test_one_pass_when_sharing_would_not_pay() -> None:
    model = tiny_policy("qwen")
    vocab = model.config.vocab_size
    distinct, attention, response = grouped_rows(vocab, groups=12, group_size=1, prompt_lengths=[40])
    assert trainable_logits(model, distinct, attention, response)[1] == 0  # 12 prompts for 12 rows
    short, attention, response = grouped_rows(
        vocab, groups=2, group_size=6, prompt_lengths=[MIN_SHARED_TOKENS]
    )
    assert trainable_logits(model, short, attention, response)[1] == 0  # too short to pay
    no_reply = response.clone()
    no_reply[0] = 0
    assert shared_length(no_reply) == 0  # a row with nothing trainable: no context bound
