"""Action formats: plain replies, words, RAGEN's answer tags, splitting, penalties, plain-format stop ids."""

from __future__ import annotations

import pytest

from rollout_server.actions import (
    ACTION_FORMATS,
    FORMAT_PENALTY,
    ParsedReply,
    env_action,
    format_instruction,
    parse_answer_tags,
    parse_plain,
    parse_reply,
    parse_words,
    plain_stop_token_ids,
)
from services.contracts import split_actions


def test_formats_are_the_protocols() -> None:
    assert ACTION_FORMATS == ("plain", "words", "answer_tags")


@pytest.mark.parametrize(
    ("reply", "action"),
    [("Left", "Left"), ("  Right\n", "Right"), ("go Up", "go Up"), ("", ""), ("a || b", "a || b")],
)
def test_plain_reply_is_the_action(reply: str, action: str) -> None:
    parsed = parse_plain(reply)
    assert parsed == ParsedReply([action], format_ok=True, penalty=0.0)
    assert env_action(parsed) == action


def test_plain_with_several_actions_splits_like_the_env_host() -> None:
    assert parse_plain("Left || Up||  || Down", max_actions=2).actions == ["Left", "Up"]
    assert parse_plain(" || ", max_actions=3).actions == [""]
    assert env_action(parse_plain("Left||Up", max_actions=2)) == "Left||Up"


def test_answer_tags_one_action() -> None:
    parsed = parse_answer_tags("<think>the goal is right</think><answer>Right</answer>")
    assert parsed.actions == ["Right"] and parsed.format_ok and parsed.penalty == 0.0
    assert parsed.think == "the goal is right"


def test_answer_tags_whitespace_and_newlines() -> None:
    reply = "  <think>\nline one\nline two\n</think>\n\n<answer>\n Up \n</answer> trailing"
    parsed = parse_answer_tags(reply)
    assert parsed.actions == ["Up"] and parsed.think == "line one\nline two"


def test_answer_tags_split_and_limited_to_max_actions() -> None:
    reply = "<think>x</think><answer>Left || Up ||Right|| Down</answer>"
    assert parse_answer_tags(reply, max_actions=3).actions == ["Left", "Up", "Right"]
    assert parse_answer_tags(reply, max_actions=1).actions == ["Left"]
    assert env_action(parse_answer_tags(reply, max_actions=2)) == "Left||Up"


def test_answer_tags_drop_empty_parts() -> None:
    assert parse_answer_tags("<think></think><answer>|| Left ||  ||</answer>", 4).actions == ["Left"]


@pytest.mark.parametrize(
    "reply",
    [
        "Right",
        "<answer>Right</answer>",  # no think
        "<think>x</think>",  # no answer
        "<think>x</think><answer>Right",  # unclosed
        "<think>x</think><answer>  || </answer>",  # nothing in the answer
        "<think>x</think><answer></answer>",
        "chatter <think>x</think><answer>Right</answer>",  # not at the start
        "",
    ],
)
def test_answer_tags_nothing_parses_gets_the_penalty(reply: str) -> None:
    parsed = parse_answer_tags(reply, max_actions=2)
    assert parsed.actions == [] and not parsed.format_ok
    assert parsed.penalty == FORMAT_PENALTY == -0.1
    assert env_action(parsed) is None


def test_answer_tags_without_think() -> None:
    parsed = parse_answer_tags("sure: <answer>Up</answer>", require_think=False)
    assert parsed.actions == ["Up"] and parsed.think is None
    assert parse_answer_tags("no tags", require_think=False).penalty == FORMAT_PENALTY


def test_first_answer_wins() -> None:
    reply = "<think>a</think><answer>Left</answer><think>b</think><answer>Up</answer>"
    assert parse_answer_tags(reply).actions == ["Left"]


def test_parse_reply_dispatches() -> None:
    assert parse_reply("Up", "plain").actions == ["Up"]
    assert parse_reply("<think>t</think><answer>Up</answer>", "answer_tags").actions == ["Up"]
    assert parse_reply("Up", "answer_tags").penalty == FORMAT_PENALTY
    with pytest.raises(ValueError, match="unknown action format"):
        parse_reply("Up", "json")  # type: ignore[arg-type]


def test_split_actions_rejects_zero() -> None:
    with pytest.raises(ValueError):
        split_actions("a", 0)


@pytest.mark.parametrize(
    ("reply", "limit", "actions"),
    [
        ("Left Down Down", 3, ["Left", "Down", "Down"]),
        ("  Left\nUp  Dragon ", 3, ["Left", "Up", "Dragon"]),  # any whitespace; the env judges each
        ("Left Down Down Up", 2, ["Left", "Down"]),  # at most the limit
        ("LeftDown", 3, ["LeftDown"]),  # words, not a search for action names
        ("", 3, [""]),  # still sent, as plain sends it: the env reports it invalid
        ("   ", 1, [""]),
    ],
)
def test_words_are_the_actions(reply: str, limit: int, actions: list[str]) -> None:
    parsed = parse_words(reply, limit)
    assert parsed.actions == actions and parsed.format_ok and parsed.penalty == 0.0
    assert parse_reply(reply, "words", limit) == parsed
    # The env host reads the same actions back from what the worker sends.
    assert (split_actions(env_action(parsed) or "", limit) or [""]) == actions
    with pytest.raises(ValueError):
        parse_words(reply, 0)


def test_format_instruction() -> None:
    assert format_instruction("plain") == ""
    assert format_instruction("words") == ""
    assert format_instruction("words", 3) == "Give up to 3 actions, separated by spaces."
    one = format_instruction("answer_tags")
    assert "<think>" in one and "<answer>" in one and "||" not in one
    assert "up to 3 actions" in format_instruction("answer_tags", 3) and "||" in format_instruction(
        "answer_tags", 3
    )


class WordTokenizer:
    """Single tokens for a few words, with and without a leading space; anything else is per character."""

    vocab = {"Left": 1, " Left": 2, "Up": 3, " Up": 4, "Dragon": 5}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [self.vocab[text]] if text in self.vocab else [100 + ord(c) for c in text]


def test_plain_stop_token_ids_single_token_spellings() -> None:
    tokenizer = WordTokenizer()
    assert plain_stop_token_ids(tokenizer, ["Left", "Up"]) == [1, 2, 3, 4]
    # "Dragon" has no single-token spaced variant; "move up" is several tokens and cannot stop.
    assert plain_stop_token_ids(tokenizer, ["Dragon", "move up"]) == [5]
    assert plain_stop_token_ids(tokenizer, None) == []
    assert plain_stop_token_ids(tokenizer, []) == []
