"""Envs a user writes in one file, served by ``stargym env serve --env <this file>:Class`` in tests.

- :class:`MyEnv` ("custom/guess"): guess a number, told "higher" or "lower" after each guess.
- :class:`SlowEnv` ("test/slow"): resets and steps that block on purpose (a delay, or a gate file
  the test creates), to show that a slow instance never stalls the others; it also records
  whether two of its calls ever ran at the same time.
- :class:`HangingEnv` ("test/hanging"): steps that spin, block, crash or raise on request, to show
  that the host stops them (env_server/sandbox.py) while its other instances step on.
- :class:`NotAnEnv` and :class:`NoMetadataEnv`: what ``--env`` must refuse with a clear message.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from env_server import Env, Observation, Step

GATE_TIMEOUT_S = 60.0


class GuessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_number: int = Field(default=100, ge=1, le=1_000_000)


class MyEnv(Env):
    name = "guess"
    family = "custom"
    instruction = "I picked a whole number from 1 to max_number. Guess it; I say 'higher' or 'lower'."
    action_format = "guess N"
    default_max_turns = 20
    reward_range = (0.0, 1.0)
    Options = GuessOptions
    runs_inline = True

    def __init__(self) -> None:
        self._rng = random.Random()
        self._secret = 0
        self._max = 1

    def reset(self, seed: int, options: GuessOptions) -> Observation:
        self._rng = random.Random(seed)
        self._max = options.max_number
        self._secret = self._rng.randint(1, options.max_number)
        return Observation(f"Guess a number from 1 to {self._max}.", {"max_number": self._max})

    def step(self, action: str) -> Step:
        words = action.split()
        if len(words) != 2 or words[0].lower() != "guess" or not words[1].isdigit():
            return Step(f"'{action}' is not 'guess N'.", 0.0, False, {"valid": False})
        guess = int(words[1])
        if guess == self._secret:
            return Step(f"{guess} is right!", 1.0, True, {"valid": True, "success": True})
        hint = "higher" if guess < self._secret else "lower"
        return Step(hint, 0.0, False, {"valid": True, "success": False})


class SlowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reset_delay_s: float = Field(default=0.0, ge=0.0, le=30.0)
    step_delay_s: float = Field(default=0.0, ge=0.0, le=30.0)
    # When set, reset writes started_file, then blocks until gate_file exists (or GATE_TIMEOUT_S).
    started_file: str | None = None
    gate_file: str | None = None
    episode_length: int = Field(default=3, ge=1)


class SlowEnv(Env):
    name = "slow"
    family = "test"
    instruction = "Say anything; the episode ends after episode_length steps."
    action_format = "any text"
    default_max_turns = 10
    reward_range = (0.0, 1.0)
    Options = SlowOptions
    runs_inline = False  # the host must run it on worker threads

    def __init__(self) -> None:
        self._options = SlowOptions()
        self._steps = 0
        self._inside = 0
        self._overlapped = False
        self._guard = threading.Lock()

    def _enter(self) -> None:
        with self._guard:
            self._inside += 1
            self._overlapped = self._overlapped or self._inside > 1

    def _leave(self) -> None:
        with self._guard:
            self._inside -= 1

    def reset(self, seed: int, options: SlowOptions) -> Observation:
        self._enter()
        try:
            if options.started_file:
                Path(options.started_file).write_text("started")
            if options.gate_file:
                deadline = time.monotonic() + GATE_TIMEOUT_S
                while not Path(options.gate_file).exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
            if options.reset_delay_s:
                time.sleep(options.reset_delay_s)
            self._options = options
            self._steps = 0
            return Observation(f"slow env, seed {seed}", {"seed": seed})
        finally:
            self._leave()

    def step(self, action: str) -> Step:
        self._enter()
        try:
            if self._options.step_delay_s:
                time.sleep(self._options.step_delay_s)
            self._steps += 1
            done = self._steps >= self._options.episode_length
            info = {"valid": True, "steps": self._steps, "overlapped": self._overlapped}
            return Step(f"step {self._steps}: {action}", 1.0 if done else 0.0, done, info)
        finally:
            self._leave()


class NotAnEnv:
    """Has the metadata but does not subclass env_server.Env."""

    name = "not"
    family = "custom"


class NoMetadataEnv(Env):
    """A subclass that forgot its class metadata."""

    def reset(self, seed: int, options: BaseModel) -> Observation:
        return Observation("")

    def step(self, action: str) -> Step:
        return Step("", 0.0, True)


class HangOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hang_in_reset: bool = False


class HangingEnv(Env):
    """A user's env that misbehaves on request: ``spin`` loops in Python forever, ``block`` sleeps
    in C for an hour, ``crash`` dies of SIGSEGV, ``raise`` breaks the never-raise contract; any
    other action is echoed. Its reset says which process it runs in (``info["pid"]``)."""

    name = "hanging"
    family = "test"
    instruction = "Say 'spin', 'block', 'crash', 'raise', or anything else."
    action_format = "any text"
    default_max_turns = 100
    reward_range = (0.0, 0.0)
    Options = HangOptions

    def reset(self, seed: int, options: HangOptions) -> Observation:
        if options.hang_in_reset:
            time.sleep(3600)
        return Observation(f"seed {seed}", {"pid": os.getpid()})

    def step(self, action: str) -> Step:
        if action == "spin":
            while True:
                pass
        if action == "block":
            time.sleep(3600)
        if action == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if action == "raise":
            raise ValueError("boom")
        return Step(action, 0.0, False, {"pid": os.getpid()})
