"""Continuous batching: every running sequence advances one token per shared forward pass.

One dedicated thread owns the model and the batch cache and runs the loop: run queued commands
(weight reload, pause), one prefill pass for the sequences waiting to join, then one decode step
for the whole batch, then release the sequences that finished. A request that arrives mid-step
joins at the next step; a finished sequence leaves at once, leaving its KV to the prefix cache for the next
turn of its episode. torch releases the GIL inside its kernels, so the asyncio event loop that
serves HTTP stays responsive while the thread computes.

A prefill pass takes the waiting prompts (after the cached part of each) together, up to
``prefill_tokens`` padded tokens, cutting a longer prompt into chunks over several passes
(:mod:`rollout_server.engine.prefill`), so a long prompt delays running decodes by one pass at
most. ``prefill_tokens=None`` is the engine before batched prefill: each prompt whole, in a pass
of its own (``bench/rollout.py`` runs both side by side).

Per-sequence work is paid only by the sequences that ask for it: penalties and ``logit_bias``
(:func:`rollout_server.engine.sampling.penalise`, on their rows only), the most likely tokens
at each step (``top_logprobs``), the decoded text for stop strings and streaming
(:class:`rollout_server.engine.detokenize.IncrementalText`, so a sequence that meets a stop
string leaves the batch at that step), and a callback after each token (``on_token``, which a
streaming handler uses to hand the token to its event loop).

Bounded memory: at most ``max_num_seqs`` sequences are admitted (running, queued, or held by a
pause), and each is at most ``max_model_len`` tokens; past either the caller gets an error
instead of a queue that grows without limit.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from transformers import PreTrainedModel

from rollout_server.engine.detokenize import IncrementalText
from rollout_server.engine.kv_cache import BatchKVCache, KVStorage, SequenceKV
from rollout_server.engine.prefill import Chunk, forward_chunks, plan_chunks
from rollout_server.engine.prefix_cache import PrefixCache
from rollout_server.engine.sampling import SequenceSampling, draw, penalise, top_logprobs
from services.logits import processed_logprobs
from services.policy import load_weights_into

log = logging.getLogger(__name__)


class EngineFull(Exception):
    """More sequences than ``max_num_seqs`` would be in flight."""


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class PauseMode(StrEnum):
    """vLLM's ``/pause`` modes."""

    ABORT = "abort"  # end in-flight sequences now (finish_reason "abort")
    WAIT = "wait"  # let in-flight sequences finish; hold new ones
    KEEP = "keep"  # freeze in-flight sequences where they are; hold new ones


@dataclass(eq=False)
class Sequence:
    """One sampled continuation of a prompt; ``done`` resolves when it finishes.

    Its random draws come from a ``torch.Generator`` of its own, seeded by the request, and are
    drawn up front (one uniform per token it may sample): the same seed gives the same tokens
    whatever else is in the batch, and a step costs no generator calls.

    ``text`` (needed for ``params.stop``, and by streams) is updated by the engine thread after
    each token; ``on_token(sequence)`` is called there after each token too, once it is known
    whether the token finished the sequence (``done`` resolves after the last call).
    """

    prompt: list[int]
    params: SequenceSampling
    text: IncrementalText | None = None
    on_token: Callable[[Sequence], None] | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, if asked
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    done: Future[Sequence] = field(default_factory=Future)
    uniforms: list[float] = field(init=False)
    weights_generation: int = field(default=0, init=False)  # weights its KV was computed with
    prefilled: int = field(default=0, init=False)  # prompt tokens whose KV is in prefill_kv
    prefill_kv: SequenceKV | None = field(default=None, init=False)
    output_counts: torch.Tensor | None = field(default=None, init=False)  # [vocab], for penalties
    prompt_seen: torch.Tensor | None = field(default=None, init=False)  # [vocab] bool, for penalties

    def __post_init__(self) -> None:
        if self.params.stop and self.text is None:
            raise ValueError("stop strings need the sequence's text (an IncrementalText)")
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().getrandbits(63)
        generator = torch.Generator().manual_seed(seed % 2**63)
        self.uniforms = torch.rand(self.params.max_tokens, generator=generator, dtype=torch.float64).tolist()


@dataclass
class EngineStats:
    """Counters for /metrics and benchmarks, updated by the engine thread only."""

    steps: int = 0
    prefills: int = 0  # sequences whose prompt was prefilled
    prefill_passes: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    busy_seconds: float = 0.0
    finished: int = 0
    reused_prompt_tokens: int = 0


class Engine:
    """The batching loop around one Hugging Face causal LM."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_id: int | None,
        extra_stop_token_ids: frozenset[int] = frozenset(),
        prefix_cache_bytes: int = 0,
        prefill_tokens: int | None = 2048,
    ) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.extra_stop_token_ids = extra_stop_token_ids
        self.prefill_tokens = prefill_tokens
        self.stats = EngineStats()
        self._cache = BatchKVCache(
            model.config.get_text_config().num_hidden_layers, max_num_seqs, max_model_len
        )
        self._prefill_storage = KVStorage()  # every prefill pass's batch KV, one pass at a time
        self._prefixes = PrefixCache(prefix_cache_bytes)
        self._weights_generation = 0
        self._running: list[Sequence] = []  # row i of the cache is self._running[i]
        self._waiting: deque[Sequence] = deque()  # admitted, not yet looked up in the prefix cache
        self._prefilling: deque[Sequence] = deque()  # in arrival order, part of the prompt to prefill
        self._held: deque[Sequence] = deque()  # arrived while paused
        self._aborts: list[Sequence] = []
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._drain_waiters: list[Future] = []
        self._admitted = 0
        self._paused = False
        self._frozen = False
        self._stopping = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---- called from other threads -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    @property
    def in_flight(self) -> int:
        return self._admitted

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, sequences: list[Sequence]) -> None:
        """Admit ``sequences`` (all or none); raises :class:`EngineFull` past ``max_num_seqs``."""
        with self._wake:
            if self._admitted + len(sequences) > self.max_num_seqs:
                raise EngineFull(
                    f"{self._admitted} sequences in flight; {len(sequences)} more would exceed "
                    f"max_num_seqs={self.max_num_seqs}"
                )
            self._admitted += len(sequences)
            (self._held if self._paused else self._waiting).extend(sequences)
            self._wake.notify()

    def abort(self, sequences: list[Sequence]) -> None:
        """End ``sequences`` early (their client went away); they finish with reason "abort"."""
        with self._wake:
            self._aborts.extend(sequences)
            self._wake.notify()

    def call(self, function: Callable[[], Any]) -> Future:
        """Run ``function`` on the engine thread between two steps; the future holds its result."""
        future: Future = Future()
        with self._wake:
            self._commands.append((function, future))
            self._wake.notify()
        return future

    def load_weights(self, path: str) -> Future:
        """Copy the checkpoint at ``path`` into the model between two steps; cached prefixes go stale."""
        return self.call(lambda: self._load_weights(path))

    def reset_prefix_cache(self) -> Future:
        return self.call(self._prefixes.clear)

    def pause(self, mode: PauseMode) -> Future:
        """Hold new sequences; the future resolves once ``mode`` is in effect (see :class:`PauseMode`)."""
        with self._wake:
            self._paused = True
        if mode is PauseMode.WAIT:
            drained: Future = Future()
            with self._wake:
                self._drain_waiters.append(drained)
                self._wake.notify()
            return drained
        if mode is PauseMode.KEEP:
            return self.call(self._freeze)
        return self.call(self._abort_all)

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._frozen = False
            self._waiting.extend(self._held)
            self._held.clear()
            self._wake.notify()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._has_work():
                        self._wake.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                started = time.perf_counter()
                # Commands first (a reload, a pause), then what was admitted before them.
                self._run_commands(commands)
                with self._wake:
                    aborts, self._aborts = self._aborts, []
                    admitted = list(self._waiting)
                    self._waiting.clear()
                try:
                    self._iterate(aborts, admitted)
                except Exception as exc:  # a bug or an OOM must fail the requests, not hang them
                    log.exception("engine step failed")
                    self._fail_all(exc, admitted)
                self.stats.busy_seconds += time.perf_counter() - started
                self._notify_drained()

    def _has_work(self) -> bool:
        return bool(
            self._stopping
            or self._commands
            or self._aborts
            or self._waiting
            or ((self._running or self._prefilling) and not self._frozen)
            or (self._drain_waiters and not self._running and not self._prefilling)
        )

    @staticmethod
    def _run_commands(commands: list[tuple[Callable[[], Any], Future]]) -> None:
        for function, future in commands:
            try:
                future.set_result(function())
            except Exception as exc:
                future.set_exception(exc)

    def _iterate(self, aborts: list[Sequence], admitted: list[Sequence]) -> None:
        for sequence in aborts:
            self._abort(sequence)
        for sequence in admitted:
            if sequence.finish_reason is None:
                self._start_prefill(sequence)
        if self._frozen:
            return
        if self.prefill_tokens is None:
            while self._prefilling:
                self._prefill_pass()
        elif self._prefilling:
            self._prefill_pass()
        if self._running:
            self._decode_step()

    def _start_prefill(self, sequence: Sequence) -> None:
        """Begin from the longest cached prefix of the prompt; the rest waits for a prefill pass."""
        sequence.prefilled, sequence.prefill_kv = self._prefixes.lookup(sequence.prompt)
        self.stats.prompt_tokens += len(sequence.prompt)
        self.stats.reused_prompt_tokens += sequence.prefilled
        self._prefilling.append(sequence)

    def _prefill_pass(self) -> None:
        """One forward pass over the next chunk of waiting prompts; those complete sample and join."""
        if self.prefill_tokens is None:
            sequence = self._prefilling[0]
            sizes = [len(sequence.prompt) - sequence.prefilled]
        else:
            remaining = [len(sequence.prompt) - sequence.prefilled for sequence in self._prefilling]
            sizes = plan_chunks(remaining, self.prefill_tokens)
        sequences = [self._prefilling.popleft() for _ in sizes]
        chunks = [
            Chunk(sequence.prompt, sequence.prefilled, sequence.prefilled + size, sequence.prefill_kv)
            for sequence, size in zip(sequences, sizes, strict=True)
        ]
        logits, kv = forward_chunks(self.model, chunks, self._prefill_storage)
        self.stats.prefill_passes += 1
        complete, unfinished = [], []
        for row, (sequence, chunk) in enumerate(zip(sequences, chunks, strict=True)):
            if chunk.end == len(sequence.prompt):
                complete.append(row)
                continue
            # kv[row] is a view of the prefill storage, which the next pass overwrites: keep a clone.
            sequence.prefilled = chunk.end
            sequence.prefill_kv = kv[row].clone()
            unfinished.append(sequence)
        self._prefilling.extendleft(reversed(unfinished))  # ahead of later arrivals, in order
        if not complete:
            return
        finishing = [sequences[row] for row in complete]
        self._sample(finishing, logits[complete])
        for row, sequence in zip(complete, finishing, strict=True):
            sequence.prefill_kv = None
            sequence.weights_generation = self._weights_generation
            self.stats.prefills += 1
            if self._after_token(sequence):
                self._prefixes.insert(sequence.prompt, kv[row].clone())
                self._release(sequence)
            else:
                self._cache.insert(kv[row])
                self._running.append(sequence)

    def _decode_step(self) -> None:
        """Feed every running sequence its last token in one forward pass; sample the next."""
        self._cache.reserve(1)
        last_tokens = torch.tensor([[sequence.output[-1]] for sequence in self._running], dtype=torch.long)
        output = self.model(
            input_ids=last_tokens,
            attention_mask=self._cache.attention_mask(1),
            position_ids=self._cache.positions(),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache.advance(1)
        self.stats.steps += 1
        self._sample(self._running, output.logits[:, -1])
        # Highest row first: removing a row moves the last one into its place.
        for row in range(len(self._running) - 1, -1, -1):
            if self._after_token(self._running[row]):
                self._leave(row)

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        params = [sequence.params for sequence in sequences]
        uniforms = torch.tensor([sequence.uniforms[len(sequence.output)] for sequence in sequences])
        temperature = torch.tensor([p.temperature for p in params])
        logits = self._penalised(sequences, logits)
        logprobs = processed_logprobs(
            logits,
            temperature,
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.top_k for p in params]),
        )
        tokens, chosen = draw(logits, logprobs, temperature, uniforms)
        self._record_top_logprobs(sequences, logprobs)
        for sequence, token, logprob in zip(sequences, tokens.tolist(), chosen.tolist(), strict=True):
            sequence.output.append(token)
            sequence.logprobs.append(logprob)
            if sequence.output_counts is not None:
                sequence.output_counts[token] += 1
        self.stats.generated_tokens += len(sequences)

    @staticmethod
    def _penalised(sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the penalties and biases of the rows that ask for them (the rest as is)."""
        rows = [row for row, sequence in enumerate(sequences) if sequence.params.changes_logits]
        if not rows:
            return logits
        vocab = logits.shape[1]
        asking = [sequences[row] for row in rows]
        bias = torch.zeros(len(rows), vocab)
        for index, sequence in enumerate(asking):
            params = sequence.params
            if sequence.output_counts is None:
                sequence.output_counts = torch.zeros(vocab)
                sequence.prompt_seen = torch.zeros(vocab, dtype=torch.bool)
                if params.repetition_penalty != 1.0:
                    sequence.prompt_seen[sequence.prompt] = True
            for token, value in params.logit_bias:
                bias[index, token] += value
        changed = penalise(
            logits[rows],
            torch.stack([sequence.output_counts for sequence in asking]),
            torch.stack([sequence.prompt_seen for sequence in asking]),
            torch.tensor([sequence.params.presence_penalty for sequence in asking]),
            torch.tensor([sequence.params.frequency_penalty for sequence in asking]),
            torch.tensor([sequence.params.repetition_penalty for sequence in asking]),
            bias,
        )
        logits = logits.float().clone()
        logits[rows] = changed
        return logits

    @staticmethod
    def _record_top_logprobs(sequences: list[Sequence], logprobs: torch.Tensor) -> None:
        rows = [row for row, sequence in enumerate(sequences) if sequence.params.top_logprobs]
        if not rows:
            return
        ids, values = top_logprobs(logprobs[rows], max(sequences[row].params.top_logprobs for row in rows))
        for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            count = sequences[row].params.top_logprobs
            sequences[row].top_logprobs.append(list(zip(row_ids[:count], row_values[:count], strict=True)))

    def _after_token(self, sequence: Sequence) -> bool:
        """Whether the token just sampled ends ``sequence``; its text and callback are updated."""
        finished = self._finished(sequence)
        if sequence.on_token is not None:
            sequence.on_token(sequence)
        return finished

    def _finished(self, sequence: Sequence) -> bool:
        """vLLM's order: end of sequence, then stop tokens, then stop strings, then length."""
        token = sequence.output[-1]
        params = sequence.params
        if token == self.eos_token_id and not params.ignore_eos:
            sequence.finish_reason = FinishReason.STOP
        elif token in params.stop_token_ids or (token in self.extra_stop_token_ids and not params.ignore_eos):
            sequence.finish_reason = FinishReason.STOP
            sequence.stop_reason = token
        elif sequence.text is not None and (stop := sequence.text.update(sequence.output)) is not None:
            sequence.finish_reason = FinishReason.STOP
            sequence.stop_reason = stop
        elif (
            len(sequence.output) >= params.max_tokens
            or len(sequence.prompt) + len(sequence.output) >= self.max_model_len
        ):
            sequence.finish_reason = FinishReason.LENGTH
        return sequence.finish_reason is not None

    def _leave(self, row: int) -> None:
        sequence = self._running[row]
        if (
            sequence.finish_reason is not FinishReason.ABORT
            and sequence.weights_generation == self._weights_generation
        ):
            # Its KV covers the prompt and every sampled token but the last (never fed back).
            self._prefixes.insert(sequence.prompt + sequence.output[:-1], self._cache.extract(row))
        self._cache.remove(row)
        self._running[row] = self._running[-1]
        self._running.pop()
        self._release(sequence)

    def _release(self, sequence: Sequence) -> None:
        with self._wake:
            self._admitted -= 1
        self.stats.finished += 1
        sequence.done.set_result(sequence)

    def _abort(self, sequence: Sequence) -> None:
        if sequence.finish_reason is not None:
            return
        sequence.finish_reason = FinishReason.ABORT
        if sequence in self._running:
            self._leave(self._running.index(sequence))
            return
        if sequence in self._prefilling:
            self._prefilling.remove(sequence)
        with self._wake:
            for queue in (self._waiting, self._held):
                if sequence in queue:
                    queue.remove(sequence)
        self._release(sequence)

    def _abort_all(self) -> None:
        with self._wake:
            queued = list(self._waiting)
        for sequence in [*self._running, *self._prefilling, *queued]:
            self._abort(sequence)

    def _load_weights(self, path: str) -> int:
        loaded = load_weights_into(self.model, path)
        self._weights_generation += 1
        self._prefixes.clear()
        for sequence in self._prefilling:  # a partial prefill's KV is the old weights': start over
            sequence.prefilled, sequence.prefill_kv = 0, None
        return loaded

    def _freeze(self) -> None:
        self._frozen = True

    def _notify_drained(self) -> None:
        with self._wake:
            if self._running or self._prefilling or self._waiting or not self._drain_waiters:
                return
            waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            waiter.set_result(None)

    def _fail_all(self, error: Exception, admitted: list[Sequence]) -> None:
        """After an unexpected error the batch state is unknown: fail everything and start clean."""
        for sequence in {*self._running, *self._prefilling, *admitted}:
            if not sequence.done.done():
                with self._wake:
                    self._admitted -= 1
                sequence.done.set_exception(error)
        self._running.clear()
        self._prefilling.clear()
        self._cache.clear()
