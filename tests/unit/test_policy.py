"""Policy checkpoints: names, atomic save, loading and in-place weight reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from deploy.tiny_model import build_model, build_tokenizer
from services.policy import (
    PolicyLoadError,
    latest_policy,
    load_policy,
    load_weights_into,
    policy_dir_name,
    policy_version,
    save_policy,
)

TEXTS = ["Reach G and avoid O.", "P _ _\n_ O G"]
ACTIONS = ["Left", "Right"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, ACTIONS)


def test_version_names_round_trip(tmp_path: Path) -> None:
    assert policy_dir_name(7) == "policy-v7"
    assert policy_version(tmp_path / "policy-v7") == 7
    assert policy_version(tmp_path / ".policy-v7.tmp-x") is None
    for version in (2, 10, 9):
        (tmp_path / policy_dir_name(version)).mkdir()
    (tmp_path / ".policy-v11.tmp-abc").mkdir()
    assert latest_policy(tmp_path) == (10, tmp_path / "policy-v10")
    assert latest_policy(tmp_path / "missing") is None


def test_save_is_complete_and_leaves_no_temp_dirs(tmp_path: Path, tokenizer) -> None:
    target = tmp_path / policy_dir_name(1)
    save_policy(build_model(tokenizer, 0), tokenizer, target)
    save_policy(build_model(tokenizer, 1), tokenizer, target)  # replaces the first
    assert [path.name for path in tmp_path.iterdir()] == ["policy-v1"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    model, _ = load_policy(target)
    expected = build_model(tokenizer, 1)
    assert torch.equal(model.lm_head.weight, expected.lm_head.weight)


def tied_model(tokenizer, seed: int) -> Qwen2ForCausalLM:
    """The tiny architecture with its LM head tied to the embedding, as many real models have it."""
    config = build_model(tokenizer, seed).config
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def test_load_weights_into_copies_in_place(tmp_path: Path, tokenizer) -> None:
    save_policy(build_model(tokenizer, 1), tokenizer, tmp_path / "one")
    model = build_model(tokenizer, 0)
    head = model.lm_head.weight
    assert load_weights_into(model, tmp_path / "one") > 0
    assert model.lm_head.weight is head
    assert torch.equal(head, build_model(tokenizer, 1).lm_head.weight)


def test_load_weights_into_a_tied_model_keeps_it_tied(tmp_path: Path, tokenizer) -> None:
    save_policy(tied_model(tokenizer, 1), tokenizer, tmp_path / "tied")  # the head is saved once
    model = tied_model(tokenizer, 0)
    load_weights_into(model, tmp_path / "tied")
    embedding = model.get_input_embeddings().weight
    assert torch.equal(embedding, tied_model(tokenizer, 1).get_input_embeddings().weight)
    assert model.lm_head.weight.data_ptr() == embedding.data_ptr()


def test_load_weights_refuses_other_architectures(tmp_path: Path, tokenizer) -> None:
    bigger = build_tokenizer([*TEXTS, "many more words here"], ACTIONS)
    save_policy(build_model(bigger, 0), bigger, tmp_path / "bigger")
    with pytest.raises(PolicyLoadError, match="shapes"):
        load_weights_into(build_model(tokenizer, 0), tmp_path / "bigger")
    with pytest.raises(PolicyLoadError, match=r"no \.safetensors"):
        load_weights_into(build_model(tokenizer, 0), tmp_path)
