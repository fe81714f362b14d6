"""Action formats: how a model's reply becomes the actions sent to an env.

``plain``: the reply is the action, stripped of surrounding whitespace. Generation stops at the
first action token (:func:`plain_stop_token_ids`), so a random policy emits short replies that end
on a valid action, which is what lets it learn.

``words``: the reply's words are its actions, up to ``max_actions_per_turn`` of them
(``Left Down Down``), for envs whose actions are single words (FrozenLake, Sokoban, the bandit).
Several actions a turn need no separator to sample, so a random policy's reply of k tokens holds
valid moves among invalid ones, and the invalid penalty's share of them (the trainer's
``shape_reward``) teaches it to write only moves: with ``plain`` and ``||`` a tiny policy from
random weights sampled no valid three-action reply in 175 updates (docs/repro/rollout-shaping).

``answer_tags``: RAGEN's ``<think>…</think><answer>…</answer>``; the answer holds up to
``max_actions_per_turn`` actions separated by ``||``. A reply with no parsable answer gets
:data:`FORMAT_PENALTY` and sends nothing to the env.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, get_args

from services.contracts import ACTION_SEPARATOR, split_actions
from services.rollout_protocol import ActionFormat

ACTION_FORMATS: tuple[str, ...] = get_args(ActionFormat)
FORMAT_PENALTY = -0.1

_THINK_ANSWER = re.compile(r"^\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """The actions a reply yields, in order, and the penalty its format earns (0 or negative)."""

    actions: list[str]
    format_ok: bool
    penalty: float = 0.0
    think: str | None = None


def parse_plain(reply: str, max_actions: int = 1) -> ParsedReply:
    """The reply is the action; with ``max_actions > 1`` it is split on ``||`` like the env host does.

    An empty reply still goes to the env (as ``""``), which reports it invalid: in plain format
    the env, not the parser, judges the action, and there is no format penalty.
    """
    if max_actions == 1:
        return ParsedReply([reply.strip()], format_ok=True)
    return ParsedReply(split_actions(reply, max_actions) or [""], format_ok=True)


def parse_words(reply: str, max_actions: int = 1) -> ParsedReply:
    """The reply's first ``max_actions`` whitespace-separated words, each an action.

    As in ``plain`` the env judges every word, and a reply with no word still goes to the env
    (as ``""``), which reports it invalid.
    """
    if max_actions < 1:
        raise ValueError("max_actions must be >= 1")
    return ParsedReply(reply.split()[:max_actions] or [""], format_ok=True)


def parse_answer_tags(
    reply: str, max_actions: int = 1, *, require_think: bool = True, penalty: float = FORMAT_PENALTY
) -> ParsedReply:
    """RAGEN's format: ``<think>…</think><answer>a1 || a2</answer>`` at the start of the reply.

    Without ``require_think`` only the first ``<answer>…</answer>`` matters. No match, or an
    answer with no action in it, gives no actions and ``penalty``.
    """
    if require_think:
        match = _THINK_ANSWER.search(reply)
        think, answer = (match.group(1).strip(), match.group(2)) if match else (None, None)
    else:
        match = _ANSWER.search(reply)
        think, answer = None, (match.group(1) if match else None)
    actions = split_actions(answer, max_actions) if answer is not None else []
    if not actions:
        return ParsedReply([], format_ok=False, penalty=penalty, think=think)
    return ParsedReply(actions, format_ok=True, think=think)


def parse_reply(reply: str, action_format: ActionFormat, max_actions: int = 1) -> ParsedReply:
    if action_format == "plain":
        return parse_plain(reply, max_actions)
    if action_format == "words":
        return parse_words(reply, max_actions)
    if action_format == "answer_tags":
        return parse_answer_tags(reply, max_actions)
    raise ValueError(f"unknown action format {action_format!r}; known: {', '.join(ACTION_FORMATS)}")


def env_action(parsed: ParsedReply) -> str | None:
    """The one string to send to the env host (it splits on ``||`` itself); None: send nothing."""
    if not parsed.actions:
        return None
    return ACTION_SEPARATOR.join(parsed.actions)


def format_instruction(action_format: ActionFormat, max_actions: int = 1) -> str:
    """What to add to the env's instruction so the model knows the reply format ("" for plain and
    one-action words)."""
    if action_format == "plain":
        return ""
    if action_format == "words":
        return f"Give up to {max_actions} actions, separated by spaces." if max_actions > 1 else ""
    many = (
        f" You may give up to {max_actions} actions, separated by {ACTION_SEPARATOR}."
        if max_actions > 1
        else " Give exactly one action."
    )
    return (
        "First think inside <think></think>, then give your action inside <answer></answer>, "
        f"e.g. <think>...</think><answer>action</answer>.{many}"
    )


def plain_stop_token_ids(tokenizer: Any, actions: Iterable[str] | None) -> list[int]:
    """Token ids that end a plain-format reply: every action that is a single token, bare or after a space.

    Actions that take several tokens cannot stop generation on their own and are left out (the
    reply then ends at EOS or ``max_tokens``); no actions (an open-text env) gives no stop ids.
    """
    stops: set[int] = set()
    for action in actions or ():
        for spelling in (action, " " + action):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if len(ids) == 1:
                stops.add(int(ids[0]))
    return sorted(stops)
