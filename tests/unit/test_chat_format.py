"""The chat template cut into turn pieces: the ids of a whole conversation, rendered once per text;
an action list's stop ids, tokenised once."""

from __future__ import annotations

from typing import Any

import pytest

from deploy.tiny_model import build_tokenizer
from rollout_server.actions import plain_stop_token_ids
from rollout_server.episode import ChatFormat

OBSERVATIONS = [
    "P _ _ G\nReach G and avoid O.",
    "_ P _ G\nReach G and avoid O.",
    "_ _ P G\nReach G and avoid O.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(["You are walking on a frozen lake.", *OBSERVATIONS], ["Left", "Right"])


def test_turn_pieces_add_up_to_the_whole_conversation(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    reply = tokenizer.encode("Right", add_special_tokens=False)
    ids = chat.first_prompt(OBSERVATIONS[0])
    messages = [{"role": "user", "content": OBSERVATIONS[0]}]
    for observation in OBSERVATIONS[1:]:
        ids += reply + chat.next_user(reply, observation)
        messages += [{"role": "assistant", "content": "Right"}, {"role": "user", "content": observation}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(whole, add_special_tokens=False)


def test_a_text_seen_before_is_neither_rendered_nor_tokenised_again(tokenizer: Any, monkeypatch) -> None:
    chat = ChatFormat(tokenizer)
    renders = []
    render = chat.render
    monkeypatch.setattr(
        chat, "render", lambda *args, **kwargs: renders.append(args) or render(*args, **kwargs)
    )
    reply = tokenizer.encode("Left", add_special_tokens=False)
    first = [chat.first_prompt(OBSERVATIONS[0]) for _ in range(8)]  # a group's 8 episodes
    after = [chat.next_user(reply, OBSERVATIONS[1]) for _ in range(8)]
    assert len(renders) == 2
    assert all(ids == first[0] for ids in first) and all(ids == after[0] for ids in after)
    chat.next_user(reply, OBSERVATIONS[2])
    assert len(renders) == 3  # a new observation is rendered


def test_an_action_list_is_tokenised_once_for_its_stop_ids(tokenizer: Any, monkeypatch) -> None:
    chat = ChatFormat(tokenizer)
    expected = plain_stop_token_ids(tokenizer, ["Left", "Right"])
    assert len(expected) == 4  # "Left", " Left", "Right", " Right": single tokens of the tiny tokenizer
    encodes = []
    encode = tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda text, **kwargs: encodes.append(text) or encode(text, **kwargs)
    )
    stops = [chat.plain_stops(["Left", "Right"]) for _ in range(8)]  # a group's 8 episodes
    assert all(ids == expected for ids in stops)
    assert len(encodes) == 4  # each spelling once
    assert chat.plain_stops(None) == [] and chat.plain_stops([]) == []
