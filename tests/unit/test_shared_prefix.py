"""Shared prompts computed once give the logits and the gradients of one ordinary forward pass."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from deploy.tiny_model import build_model, build_tokenizer
from trainer.shared_prefix import MIN_SHARED_TOKENS, causal_logits, shared_length


def tiny_policy(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mistral":  # a sliding window (24) shorter than the rows
        config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, sliding_window=24)  # fmt: skip
        return MistralForCausalLM(config)
    return build_model(
        build_tokenizer(["You are walking on a frozen lake. P _ O G"], ["Left", "Right"]), seed=0
    )


def grouped_rows(vocab: int, groups: int, group_size: int, prompt_lengths: list[int], seed: int = 0):
    """Right-padded rows: each group's rows share a prompt, then replies (trainable) and observations."""
    rng = random.Random(seed)
    rows, masks = [], []
    for group in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_lengths[group % len(prompt_lengths)])]
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


def trainable_logprobs(model, input_ids, attention, response, share: bool):
    """Log-probs of the trainable tokens, and the gradient of their sum."""
    model.zero_grad(set_to_none=True)
    logits, start = causal_logits(model, input_ids, attention, response, share_prompts=share)
    targets = input_ids[:, start + 1 :]
    picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    chosen = picked[response[:, start + 1 :].bool()]
    chosen.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return chosen.detach(), start, grads


@pytest.mark.parametrize("name", ["qwen", "mistral"])
def test_shared_prompts_give_the_logprobs_and_gradients_of_one_pass(name: str) -> None:
    model = tiny_policy(name)
    vocab = model.config.vocab_size
    input_ids, attention, response = grouped_rows(vocab, groups=4, group_size=6, prompt_lengths=[40, 33])
    plain, plain_start, plain_grads = trainable_logprobs(model, input_ids, attention, response, share=False)
    shared, start, grads = trainable_logprobs(model, input_ids, attention, response, share=True)
    assert plain_start == 0 and start == 32  # the shortest prompt, less the token its logits come from
    assert shared == pytest.approx(plain, abs=1e-5)
    assert grads.keys() == plain_grads.keys()
    for parameter, grad in plain_grads.items():
        assert torch.allclose(grads[parameter], grad, atol=1e-5, rtol=1e-4), parameter


def test_one_pass_when_sharing_would_not_pay() -> None:
    model = tiny_policy("qwen")
    vocab = model.config.vocab_size
    distinct, attention, response = grouped_rows(vocab, groups=12, group_size=1, prompt_lengths=[40])
    assert causal_logits(model, distinct, attention, response)[1] == 0  # 12 prompts for 12 rows
    short, attention, response = grouped_rows(
        vocab, groups=2, group_size=6, prompt_lengths=[MIN_SHARED_TOKENS]
    )
    assert causal_logits(model, short, attention, response)[1] == 0  # too short to pay
    no_reply = response.clone()
    no_reply[0] = 0
    assert shared_length(no_reply) == 0  # a row with nothing trainable: no context bound
