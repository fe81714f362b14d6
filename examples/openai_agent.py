"""An agent written with nothing but the ``openai`` package, trained by stargym as it is.

This is the README's worked example ("Train your own agent"). Point a run at it with

    rollout:
      agent: examples.openai_agent:play

and every episode of the run, training and evaluation, is this function talking to the policy
through the rollout worker's recording proxy: the worker records the exact token ids the policy
sampled and their log-probs, and the trainer learns from them. Nothing here imports stargym.

``task`` carries the env's instruction, first observation and the turn limit (``max_turns``,
the horizon of the run's ScalingInter-RL schedule); ``env.step(action)`` acts in the episode's
env instance and returns ``observation``, ``reward``, ``done`` and ``info``. Returning None
makes the episode's reward the env's total; return a number to score the episode yourself.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI


async def play(client: AsyncOpenAI, task: Any, env: Any) -> float | None:
    """A plain chat loop: the instruction and observation in, the reply sent to the env as the action."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"{task.instruction}\n\n{task.observation}"}
    ]
    for _ in range(task.max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        action = reply.choices[0].message.content or ""
        result = await env.step(action)
        if result.done:
            break
        messages += [
            {"role": "assistant", "content": action},
            {"role": "user", "content": result.observation},
        ]
    return None
