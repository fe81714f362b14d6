"""The text of a sequence as it is generated: stop strings, and what a stream may send so far.

:class:`IncrementalText` runs on the engine thread, one token at a time, for the sequences that
need text before they finish (a request with ``stop`` strings, or a streamed one). It follows
vLLM's incremental detokenisation: each step decodes a short window of the newest tokens (from
the last point where the text was whole) instead of the whole output, so a step costs the same
at token 10 and at token 2000, and it appends nothing while the window's text ends in U+FFFD, the
replacement for a UTF-8 character whose bytes are not all sampled yet. Decoding a window that
starts at a token boundary where the text so far was whole gives the same characters as decoding
the whole output (byte-level BPE decodes the bytes of its tokens; SentencePiece's leading space
is why the window starts one emission back, as vLLM's ``prefix_offset`` does), so the text is
always a prefix of ``decode(output)``.

Stop strings are looked for in the newest characters only (the new text and the
``len(stop) - 1`` characters before it): an earlier occurrence would have stopped an earlier
step. When several are found the one that starts first wins, and the text is cut before it
(vLLM's default, ``include_stop_str_in_output`` false); the token ids keep every sampled token.

:func:`unsent_stop_prefix` is the part of a stream's text that must wait: a tail that a later
token could complete into a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalText:
    """The decoded output of one sequence, token by token; the engine thread owns it.

    ``decode(token_ids)`` is the tokenizer's decode with the request's ``skip_special_tokens``.
    After :meth:`update` found a stop string, ``text`` ends before it and ``stop`` names it.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(stop)
        self.longest_stop = max((len(stop) for stop in self.stops), default=0)
        self.text = ""
        self.stop: str | None = None
        self._prefix_offset = 0  # the window starts here: the end of the emission before the last
        self._read_offset = 0  # tokens whose text is in self.text

    def update(self, output: list[int]) -> str | None:
        """Take the tokens of ``output`` not seen yet; the stop string they complete, if any."""
        if self.stop is not None:
            return self.stop
        window = output[self._prefix_offset :]
        prefix = self.decode(output[self._prefix_offset : self._read_offset])
        whole = self.decode(window)
        if len(whole) <= len(prefix) or whole.endswith(REPLACEMENT_CHARACTER):
            return None  # nothing new, or a character not complete yet: wait for more bytes
        new = whole[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output)
        self.text += new
        if self.stops:
            self._find_stop(len(new))
        return self.stop

    def _find_stop(self, new_characters: int) -> None:
        start = max(0, len(self.text) - new_characters - self.longest_stop + 1)
        found = [(index, stop) for stop in self.stops if (index := self.text.find(stop, start)) >= 0]
        if found:
            index, self.stop = min(found, key=lambda match: match[0])
            self.text = self.text[:index]


def unsent_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` begin some stop string (and may yet become it)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
