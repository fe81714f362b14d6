"""The CPU engine's text work: incremental decoding with stop strings, and the chat route's tool calls."""

from __future__ import annotations

import itertools
import json

import pytest

from deploy.tiny_model import build_tokenizer
from rollout_server.engine.chat import parse_tool_calls, template_messages, template_tools
from rollout_server.engine.detokenize import IncrementalText, unsent_stop_prefix
from services.engine_protocol import ChatCompletionRequest
from services.errors import ApiError

TEXTS = ["Reach the € goal and stop here.", "Go Left then Right. END"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, ["Left", "Right"])


def feed(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[IncrementalText, list[str]]:
    """Feed ``ids`` one token at a time, as the engine thread does; the text after each token."""
    text = IncrementalText(tokenizer.decode, stop)
    seen = []
    for end in range(1, len(ids) + 1):
        if text.update(ids[:end]) is not None:
            break
        seen.append(text.text)
    return text, seen


def test_incremental_text_is_the_whole_decode_and_never_half_a_character(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[0])
    euro = tokenizer.encode("€")
    assert len(euro) == 2 and all(tokenizer.decode([token]) == "\ufffd" for token in euro)
    text, seen = feed(tokenizer, ids)
    assert text.text == tokenizer.decode(ids) == TEXTS[0]
    assert all("\ufffd" not in piece for piece in seen)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(seen))


def test_a_stop_string_ends_the_text_before_it(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[1])
    text, _ = feed(tokenizer, ids, stop=("then",))
    assert text.stop == "then" and text.text == "Go Left "
    # The first occurrence wins, even when a later-listed stop string starts first.
    text, _ = feed(tokenizer, ids, stop=("Right", "Left then"))
    assert text.stop == "Left then" and text.text == "Go "


def test_a_stop_string_across_tokens_and_one_never_met(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[1])
    text, _ = feed(tokenizer, ids, stop=("n Ri",))  # "then" and " Right" are tokens of their own
    assert text.stop == "n Ri" and text.text == "Go Left the"
    text, _ = feed(tokenizer, ids, stop=("nowhere",))
    assert text.stop is None and text.text == TEXTS[1]


def test_unsent_stop_prefix_holds_what_could_become_a_stop() -> None:
    assert unsent_stop_prefix("Go Le", ("Left",)) == 2
    assert unsent_stop_prefix("Go L", ("Left", "Lo")) == 1
    assert unsent_stop_prefix("Go", ("Left",)) == 0
    assert unsent_stop_prefix("abc", ("cde", "bcx")) == 2
    assert unsent_stop_prefix("", ("x",)) == 0


def test_tool_calls_are_parsed_from_hermes_blocks() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    reply = parse_tool_calls(text)
    assert reply.content == "Let me look.\n\n"
    assert [call.function.name for call in reply.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(reply.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert all(call.id.startswith("call_") and call.type == "function" for call in reply.tool_calls)
    assert len(parse_tool_calls(text, parallel=False).tool_calls) == 1


def test_a_reply_of_only_a_tool_call_has_no_content_and_an_unclosed_block_counts() -> None:
    reply = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>\n')
    assert reply.content is None and reply.tool_calls[0].function.arguments == '{"x": [1, 2]}'
    unclosed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}')
    assert unclosed.content is None and unclosed.tool_calls[0].function.name == "f"


@pytest.mark.parametrize(
    "text",
    [
        "no tool call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
    ],
)
def test_a_reply_without_a_well_formed_call_is_plain_content(text: str) -> None:
    reply = parse_tool_calls(text)
    assert reply.content == text and reply.tool_calls == []
    # A block that does not parse is a call written badly; text with no block is no call at all.
    assert reply.malformed == ("<tool_call>" in text)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(messages: list[dict], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def test_messages_reach_the_template_as_transformers_expects() -> None:
    request = chat(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=TOOLS,
    )
    assert template_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert template_tools(request) == TOOLS


@pytest.mark.parametrize(
    ("messages", "fields", "code"),
    [
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                    ],
                }
            ],
            {},
            "bad_tool_call_arguments",
        ),
        ([{"role": "user", "content": "x"}], {"tool_choice": "auto"}, "tool_choice_without_tools"),
        (
            [{"role": "user", "content": "x"}],
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "unknown_tool",
        ),
    ],
)
def test_tool_requests_the_engine_cannot_render_are_400(
    messages: list[dict], fields: dict, code: str
) -> None:
    request = chat(messages, **fields)
    with pytest.raises(ApiError) as refused:
        template_tools(request)
        template_messages(request)
    assert refused.value.status == 400 and refused.value.code == code
