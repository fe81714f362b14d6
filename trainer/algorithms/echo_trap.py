"""Echo-trap watch: warn when multi-turn RL starts collapsing (RAGEN's "Echo Trap") or has
nothing to learn from.

The Echo Trap: the policy locks onto a few repetitive reasoning patterns; rewards inside each
group stop varying (nothing left to compare), entropy falls, and the gradient norm spikes before
the run collapses. :class:`EchoTrapDetector` is fed one set of stats per update and returns
structured warnings:

* ``"collapse"``: the rolling means of in-group reward std *and* entropy are both below
  ``collapse_fraction`` of their own peak rolling mean so far, *and* the rolling mean reward has
  fallen from its peak by at least ``reward_drop`` peak in-group stds. No one of them is enough:
  entropy falls in any run that learns, reward std falls when a task is solved, and both fall
  together when a policy converges on the right answer (without the reward condition the warning
  fired 9 to 26 times in each run of ``stargym repro echo-trap`` while held-out success stayed at
  0.40 to 0.58). Only a falling reward tells the trap from convergence. When the caller passes no
  reward, the first two conditions decide.
* ``"grad_spike"``: the gradient norm exceeds ``spike_factor`` times the median of the previous
  ``spike_window`` norms (or is not finite).
* ``"no_signal"``: every group's episodes got the same reward for ``no_signal_window`` updates in
  a row. Group-relative advantages are then all zero and the update learns nothing, while the
  run looks healthy (no error, updates keep coming). ``"collapse"`` cannot see it: a reward std
  that never rose has no peak to fall from. A Sokoban recipe ran 68 updates at reward exactly
  -1.000 before anyone noticed.

Each kind fires at most once per ``cooldown`` updates. The detector only reads numbers; the
trainer logs the event (and may act on it). Its state round-trips through ``state_dict`` for
checkpoints.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

EventKind = Literal["collapse", "grad_spike", "no_signal"]


@dataclass(frozen=True)
class EchoTrapConfig:
    """Thresholds. ``window``: updates in each rolling mean (collapse needs a full window).
    ``collapse_fraction``: the current rolling mean must fall below this share of the peak one.
    ``reward_drop``: how far the rolling mean reward must have fallen from its peak, in peak
    in-group reward stds (0.5: a fall of 0.25 in a 0/1 success whose groups were split half/half).
    ``min_reward_std_peak`` / ``min_entropy_peak``: a peak below this is noise, not a reference
    (a run whose reward std never rose has nothing to collapse from). ``spike_factor``,
    ``spike_window``, ``spike_min_history``: grad-norm spike test. ``no_signal_window``: updates
    in a row without reward variance in any group before ``"no_signal"`` fires. ``cooldown``:
    updates between two events of the same kind (default: ``window``)."""

    window: int = 10
    collapse_fraction: float = 0.25
    reward_drop: float = 0.5
    min_reward_std_peak: float = 1e-3
    min_entropy_peak: float = 1e-3
    spike_factor: float = 10.0
    spike_window: int = 20
    spike_min_history: int = 5
    no_signal_window: int = 5
    cooldown: int | None = None

    def __post_init__(self) -> None:
        if min(self.window, self.spike_window, self.spike_min_history, self.no_signal_window) < 1:
            raise ValueError("window, spike_window, spike_min_history and no_signal_window must be >= 1")
        if not 0.0 < self.collapse_fraction < 1.0:
            raise ValueError(f"collapse_fraction must be in (0, 1), got {self.collapse_fraction}")
        if self.reward_drop < 0.0:
            raise ValueError(f"reward_drop must be >= 0, got {self.reward_drop}")
        if self.spike_factor <= 1.0:
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")


@dataclass(frozen=True)
class EchoTrapEvent:
    """One warning: ``kind``, the update ``step``, a human-readable ``message`` and the numbers."""

    kind: EventKind
    step: int
    message: str
    details: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EchoTrapDetector:
    """Stateful watch over per-update stats; see the module docstring."""

    def __init__(self, config: EchoTrapConfig | None = None) -> None:
        self.config = config or EchoTrapConfig()
        window = self.config.window
        self._reward_std: deque[float] = deque(maxlen=window)
        self._entropy: deque[float] = deque(maxlen=window)
        self._length: deque[float] = deque(maxlen=window)
        self._reward_mean: deque[float] = deque(maxlen=window)
        self._grad_norm: deque[float] = deque(maxlen=self.config.spike_window)
        self._peak_reward_std = 0.0
        self._peak_entropy = 0.0
        self._peak_length = 0.0
        self._peak_reward_mean: float | None = None  # None until the first full window of rewards
        self._flat_updates = 0  # updates in a row in which no group's rewards varied
        self._last_fired: dict[str, int] = {}

    # -- feeding ---------------------------------------------------------------------------

    def update(
        self,
        step: int,
        reward_std: float,
        entropy: float,
        grad_norm: float | None = None,
        response_length: float | None = None,
        groups_with_signal: float | None = None,
        reward_mean: float | None = None,
    ) -> list[EchoTrapEvent]:
        """Record one update's stats and return the warnings it triggers (usually none).

        reward_std: mean over groups of the in-group reward std (``rollout/in_group_std``).
        entropy: mean token entropy of the policy (``train/entropy``).
        grad_norm: gradient norm before clipping (``train/grad_norm``); ``None`` skips the check.
        response_length: mean response length in tokens; reported in the collapse event.
        groups_with_signal: share of the batch's groups whose episodes' rewards differ
        (``rollout/groups_with_signal``); ``None`` (no group of two or more episodes) skips the check.
        reward_mean: mean episode reward (``rollout/reward_mean``): a collapse needs it to have
        fallen from its peak; also reported in the no-signal event. ``None`` skips that condition.
        """
        events: list[EchoTrapEvent] = []
        spike = self._check_grad_spike(step, grad_norm)
        if spike is not None:
            events.append(spike)
        no_signal = self._check_no_signal(step, groups_with_signal, reward_mean)
        if no_signal is not None:
            events.append(no_signal)

        self._reward_std.append(float(reward_std))
        self._entropy.append(float(entropy))
        if response_length is not None:
            self._length.append(float(response_length))
        if reward_mean is not None:
            self._reward_mean.append(float(reward_mean))
        if len(self._reward_std) < self.config.window:
            return events
        std_now = statistics.fmean(self._reward_std)
        entropy_now = statistics.fmean(self._entropy)
        self._peak_reward_std = max(self._peak_reward_std, std_now)
        self._peak_entropy = max(self._peak_entropy, entropy_now)
        length_now = statistics.fmean(self._length) if self._length else math.nan
        if self._length:
            self._peak_length = max(self._peak_length, length_now)
        reward_now = statistics.fmean(self._reward_mean) if self._reward_mean else None
        if reward_now is not None:
            peak = self._peak_reward_mean
            self._peak_reward_mean = reward_now if peak is None else max(peak, reward_now)

        fraction = self.config.collapse_fraction
        std_collapsed = (
            self._peak_reward_std >= self.config.min_reward_std_peak
            and std_now < fraction * self._peak_reward_std
        )
        entropy_collapsed = (
            self._peak_entropy >= self.config.min_entropy_peak and entropy_now < fraction * self._peak_entropy
        )
        reward_fell = (
            reward_now is None
            or self._peak_reward_mean is None
            or self._peak_reward_mean - reward_now >= self.config.reward_drop * self._peak_reward_std
        )
        if std_collapsed and entropy_collapsed and reward_fell and self._ready("collapse", step):
            details = {
                "reward_std": std_now,
                "reward_std_peak": self._peak_reward_std,
                "entropy": entropy_now,
                "entropy_peak": self._peak_entropy,
            }
            message = (
                f"echo trap: in-group reward std {std_now:.4g} (peak {self._peak_reward_std:.4g}) and "
                f"entropy {entropy_now:.4g} (peak {self._peak_entropy:.4g}) both fell below "
                f"{fraction:g}x their peak over the last {self.config.window} updates"
            )
            if reward_now is not None and self._peak_reward_mean is not None:
                details |= {"reward_mean": reward_now, "reward_mean_peak": self._peak_reward_mean}
                message += (
                    f", and the mean reward fell to {reward_now:.4g} (peak {self._peak_reward_mean:.4g})"
                )
            if self._length:
                details |= {"response_length": length_now, "response_length_peak": self._peak_length}
                message += f"; response length {length_now:.4g} (peak {self._peak_length:.4g})"
            events.append(EchoTrapEvent("collapse", step, message, details))
        return events

    def _check_grad_spike(self, step: int, grad_norm: float | None) -> EchoTrapEvent | None:
        if grad_norm is None:
            return None
        grad_norm = float(grad_norm)
        event = None
        if not math.isfinite(grad_norm):
            if self._ready("grad_spike", step):
                event = EchoTrapEvent(
                    "grad_spike", step, f"echo trap: gradient norm is {grad_norm}", {"grad_norm": grad_norm}
                )
            return event  # a non-finite norm never enters the history
        if len(self._grad_norm) >= self.config.spike_min_history:
            median = statistics.median(self._grad_norm)
            if grad_norm > self.config.spike_factor * median and self._ready("grad_spike", step):
                event = EchoTrapEvent(
                    "grad_spike",
                    step,
                    f"echo trap: gradient norm {grad_norm:.4g} is {grad_norm / max(median, 1e-12):.1f}x the "
                    f"median {median:.4g} of the last {len(self._grad_norm)} updates",
                    {"grad_norm": grad_norm, "grad_norm_median": median},
                )
        self._grad_norm.append(grad_norm)
        return event

    def _check_no_signal(
        self, step: int, groups_with_signal: float | None, reward_mean: float | None
    ) -> EchoTrapEvent | None:
        if groups_with_signal is None:
            return None
        self._flat_updates = self._flat_updates + 1 if groups_with_signal == 0 else 0
        if self._flat_updates < self.config.no_signal_window or not self._ready("no_signal", step):
            return None
        rewards = f" (mean reward {reward_mean:.4g})" if reward_mean is not None else ""
        message = (
            f"no learning signal: in each of the last {self._flat_updates} updates every group's "
            f"episodes got the same reward{rewards}, so every group-relative advantage is zero and "
            "the update learns nothing from rewards; make them differ within a group (a penalty for invalid "
            "actions, a one-turn first stage in curriculum.horizon_schedule, a higher sampling "
            "temperature, an easier task)"
        )
        details = {"updates": float(self._flat_updates)}
        if reward_mean is not None:
            details["reward_mean"] = float(reward_mean)
        return EchoTrapEvent("no_signal", step, message, details)

    def _ready(self, kind: str, step: int) -> bool:
        """Whether ``kind`` may fire at ``step`` (cooldown); marks it fired if so."""
        cooldown = self.config.cooldown if self.config.cooldown is not None else self.config.window
        last = self._last_fired.get(kind)
        if last is not None and step - last < cooldown:
            return False
        self._last_fired[kind] = step
        return True

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "reward_std": list(self._reward_std),
            "entropy": list(self._entropy),
            "length": list(self._length),
            "reward_mean": list(self._reward_mean),
            "grad_norm": list(self._grad_norm),
            "peak_reward_std": self._peak_reward_std,
            "peak_entropy": self._peak_entropy,
            "peak_length": self._peak_length,
            "peak_reward_mean": self._peak_reward_mean,
            "flat_updates": self._flat_updates,
            "last_fired": dict(self._last_fired),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reward_std.clear()
        self._reward_std.extend(state["reward_std"])
        self._entropy.clear()
        self._entropy.extend(state["entropy"])
        self._length.clear()
        self._length.extend(state["length"])
        self._reward_mean.clear()
        self._reward_mean.extend(state.get("reward_mean", []))  # absent from older checkpoints
        self._grad_norm.clear()
        self._grad_norm.extend(state["grad_norm"])
        self._peak_reward_std = float(state["peak_reward_std"])
        self._peak_entropy = float(state["peak_entropy"])
        self._peak_length = float(state["peak_length"])
        peak_reward_mean = state.get("peak_reward_mean")
        self._peak_reward_mean = None if peak_reward_mean is None else float(peak_reward_mean)
        self._flat_updates = int(state.get("flat_updates", 0))  # absent from older checkpoints
        self._last_fired = {str(kind): int(step) for kind, step in state["last_fired"].items()}
