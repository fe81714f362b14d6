"""What the generation routes answer, from finished (or streaming) sequences: text and log-probs.

Shared by the plain responses (:mod:`rollout_server.engine.app`) and the server-sent events
(:mod:`rollout_server.engine.streaming`), so a streamed reply is the same text and log-probs as
the plain one, split into pieces.

Log-probs are those of the distribution each token was drawn from, and so are the most likely
tokens listed beside it (``top_logprobs``): vLLM's ``processed_logprobs``. A token is named by
its text decoded alone, as vLLM names it (a byte of an unfinished UTF-8 character reads as
U+FFFD, and its ``bytes`` are those of U+FFFD, where OpenAI gives the raw byte).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout_server.engine.scheduler import Sequence as EngineSequence
from services.engine_protocol import (
    ChatCompletionLogProbs,
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
)

MIN_LOGPROB = -9999.0  # vLLM's floor, so -inf never reaches JSON
TokenText = Callable[[int], str]


def final_text(sequence: EngineSequence, decode: Callable[[Sequence[int]], str]) -> str:
    """The reply's text: cut before the stop string that ended it, else the whole output decoded."""
    if sequence.text is not None and sequence.text.stop is not None:
        return sequence.text.text
    return decode(sequence.output)


def finish_reason(sequence: EngineSequence) -> str | None:
    return sequence.finish_reason.value if sequence.finish_reason else None


def completion_logprobs(
    sequence: EngineSequence, start: int, end: int, token_text: TokenText, text_offset: int = 0
) -> CompletionLogProbs:
    """vLLM's completion log-probs of tokens ``start:end``: each token's text, offset (from
    ``text_offset``), log-prob, and in ``top_logprobs`` the sampled token and the ``logprobs``
    most likely ones of its distribution."""
    tokens = [token_text(token) for token in sequence.output[start:end]]
    values = [max(value, MIN_LOGPROB) for value in sequence.logprobs[start:end]]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    tops: list[dict[str, float] | None] = []
    for position, (token, value) in enumerate(zip(tokens, values, strict=True), start):
        top = {token: value}
        if sequence.params.top_logprobs:
            for candidate, logprob in sequence.top_logprobs[position]:
                top.setdefault(token_text(candidate), max(logprob, MIN_LOGPROB))
        tops.append(top)
    return CompletionLogProbs(text_offset=offsets, token_logprobs=values, tokens=tokens, top_logprobs=tops)


def chat_logprobs(
    sequence: EngineSequence, start: int, end: int, token_text: TokenText
) -> ChatCompletionLogProbs:
    """OpenAI's ``logprobs.content`` of tokens ``start:end``, each with its ``top_logprobs`` most
    likely alternatives (none unless asked)."""
    content = []
    for position in range(start, end):
        token = token_text(sequence.output[position])
        tops = sequence.top_logprobs[position] if sequence.params.top_logprobs else []
        content.append(
            ChatLogProbsContent(
                token=token,
                logprob=max(sequence.logprobs[position], MIN_LOGPROB),
                bytes=_bytes(token),
                top_logprobs=[
                    ChatLogProb(
                        token=(text := token_text(candidate)),
                        logprob=max(value, MIN_LOGPROB),
                        bytes=_bytes(text),
                    )
                    for candidate, value in tops
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
