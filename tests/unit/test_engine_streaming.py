"""The CPU engine's server-sent events, from scripted sequences: what a client joins is the plain reply.

Each test plays the engine thread's part by hand (append a token, call ``on_token``, finish,
resolve ``done``) on the event loop's own thread, so the order of reports is exact.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from deploy.tiny_model import build_tokenizer
from rollout_server.engine.detokenize import IncrementalText
from rollout_server.engine.sampling import SequenceSampling
from rollout_server.engine.scheduler import FinishReason, Sequence
from rollout_server.engine.streaming import ProgressQueue, StreamContext, chat_events, completion_events

REPLY = 'Sure.\n<tool_call>\n{"name": "move", "arguments": {"dir": "Left"}}\n</tool_call>'
TEXTS = ["Reach the € goal and stop here.", REPLY]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, ["Left", "Right"])


async def play(
    tokenizer, reply: str, make_events, stop: tuple[str, ...] = (), **context_fields
) -> tuple[list[dict], Sequence]:
    """Generate ``reply``'s tokens one by one into a stream; the events' JSON payloads (and [DONE])."""
    tokens = tokenizer.encode(reply)
    params = SequenceSampling(max_tokens=len(tokens), stop=stop, top_logprobs=0)
    sequence = Sequence([1, 2], params, text=IncrementalText(tokenizer.decode, stop))
    progress = ProgressQueue([sequence])
    context = StreamContext(
        model="tiny",
        prompt=[1, 2],
        sequences=[sequence],
        token_text=lambda token: tokenizer.decode([token]),
        decode=tokenizer.decode,
        stops=stop,
        **context_fields,
    )
    events = make_events(context, progress)
    collected: list[str] = []

    async def read() -> None:
        async for event in events:
            collected.append(event)

    reader = asyncio.create_task(read())
    for token in tokens:
        sequence.output.append(token)
        sequence.logprobs.append(-1.0)
        if sequence.text.update(sequence.output) is not None:
            sequence.finish_reason, sequence.stop_reason = FinishReason.STOP, sequence.text.stop
        elif len(sequence.output) == len(tokens):
            sequence.finish_reason = FinishReason.LENGTH
        sequence.on_token(sequence)
        await asyncio.sleep(0)  # let the stream send what it may
        if sequence.finish_reason is not None:
            break
    sequence.done.set_result(sequence)
    await asyncio.wait_for(reader, timeout=10)
    assert all(event.startswith("data: ") and event.endswith("\n\n") for event in collected)
    assert collected[-1] == "data: [DONE]\n\n"
    return [json.loads(event[6:]) for event in collected[:-1]], sequence


async def test_chat_stream_joins_into_the_reply_with_role_first_and_usage_last(tokenizer) -> None:
    chunks, sequence = await play(tokenizer, TEXTS[0], chat_events, include_usage=True, logprobs=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    pieces = [chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks[1:-1]]
    assert len(pieces) > 3 and "".join(pieces) == TEXTS[0]
    assert all("\ufffd" not in piece for piece in pieces)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    joined = [
        item
        for chunk in chunks[:-1]
        for item in (chunk["choices"][0]["logprobs"] or {"content": []})["content"]
    ]
    assert len(joined) == len(sequence.output)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(sequence.output)


async def test_a_streamed_stop_string_is_never_sent(tokenizer) -> None:
    chunks, _ = await play(tokenizer, TEXTS[0], chat_events, stop=("stop here",), include_usage=False)
    assert "usage" not in chunks[-1]
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert content == "Reach the € goal and "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "stop here"


async def test_tool_calls_stream_as_one_delta_at_the_end(tokenizer) -> None:
    chunks, _ = await play(tokenizer, REPLY, chat_events, include_usage=False, tool_calls=True)
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert content == "Sure.\n" and "<tool" not in content
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "move", "arguments": '{"dir": "Left"}'}


async def test_completion_stream_carries_text_token_ids_and_offsets(tokenizer) -> None:
    chunks, sequence = await play(
        tokenizer, TEXTS[0], completion_events, include_usage=False, logprobs=True, return_token_ids=True
    )
    choices = [chunk["choices"][0] for chunk in chunks]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert "".join(choice["text"] for choice in choices) == TEXTS[0]
    assert [token for choice in choices for token in choice["token_ids"]] == sequence.output
    assert choices[0]["prompt_token_ids"] == [1, 2] and choices[1]["prompt_token_ids"] is None
    offsets = [
        offset for choice in choices if choice["logprobs"] for offset in choice["logprobs"]["text_offset"]
    ]
    texts = [token for choice in choices if choice["logprobs"] for token in choice["logprobs"]["tokens"]]
    assert offsets == [sum(len(text) for text in texts[:index]) for index in range(len(texts))]
    assert choices[-1]["finish_reason"] == "length"
