"""Echo-trap watch: collapse of reward std, entropy and reward together, gradient-norm spikes."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from trainer.algorithms.echo_trap import EchoTrapConfig, EchoTrapDetector


def feed(detector: EchoTrapDetector, series, start: int = 0):
    """Feed (std, entropy, grad norm, length[, mean reward]) tuples; returns the events."""
    events = []
    for offset, (std, entropy, grad, length, *reward) in enumerate(series):
        events += detector.update(
            start + offset, std, entropy, grad, length, reward_mean=reward[0] if reward else None
        )
    return events


def steady(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [
        (
            0.4 + rng.uniform(-0.1, 0.1),
            1.5 + rng.uniform(-0.2, 0.2),
            1.0 + rng.uniform(-0.4, 0.4),
            12 + rng.randint(-3, 3),
        )
        for _ in range(n)
    ]


def test_no_false_alarm_on_a_steady_noisy_series() -> None:
    for seed in range(5):
        assert feed(EchoTrapDetector(), steady(300, seed)) == []


def test_no_alarm_when_entropy_falls_but_rewards_still_vary() -> None:
    # a run that learns: entropy drops a lot, in-group std stays
    series = [(0.4, 2.0 * math.exp(-i / 20), 1.0, 10) for i in range(200)]
    assert feed(EchoTrapDetector(), series) == []


def test_no_alarm_when_reward_std_falls_but_entropy_stays() -> None:
    # a solved task: every group all-success, std 0, entropy fine
    series = [(0.4 if i < 50 else 0.0, 1.5, 1.0, 10) for i in range(200)]
    assert feed(EchoTrapDetector(), series) == []


def test_no_alarm_when_reward_std_never_rose() -> None:
    # an untrained policy that never succeeds: std 0 from the start
    series = [(0.0, 1.5 if i < 50 else 0.01, 1.0, 10) for i in range(200)]
    assert feed(EchoTrapDetector(), series) == []


def test_fires_when_reward_std_and_entropy_collapse_together() -> None:
    detector = EchoTrapDetector(EchoTrapConfig(window=10, collapse_fraction=0.25))
    before = steady(40)
    collapse = [(0.01, 0.05, 1.0, 3) for _ in range(30)]
    assert feed(detector, before) == []
    events = feed(detector, collapse, start=40)
    assert events, "no warning on a collapse"
    first = events[0]
    assert first.kind == "collapse"
    # rolling mean of 10: the mix falls below 0.25 x peak after about 8 collapsed updates
    assert 45 <= first.step <= 50
    assert "reward std" in first.message and "entropy" in first.message
    assert first.details["reward_std"] < 0.25 * first.details["reward_std_peak"]
    assert first.details["entropy"] < 0.25 * first.details["entropy_peak"]
    assert "response_length" in first.details
    assert first.to_dict()["kind"] == "collapse"
    # cooldown: a collapse that persists for 30 updates is reported about every window, not every step
    assert 2 <= len(events) <= 3
    assert all(b.step - a.step >= 10 for a, b in itertools.pairwise(events))


def test_no_collapse_alarm_when_the_policy_converges_on_the_answer() -> None:
    # FrozenLake solved: groups all succeed (std 0), the policy is sure (entropy ~0), reward holds
    learning = [(0.45, 1.5 - i / 40, 1.0, 10, 0.2 + i / 100) for i in range(40)]
    converged = [(0.02, 0.03, 1.0, 10, 0.6) for _ in range(100)]
    assert feed(EchoTrapDetector(), learning + converged) == []


def test_collapse_alarm_when_the_reward_falls_with_std_and_entropy() -> None:
    learning = [(0.45, 1.5 - i / 40, 1.0, 10, 0.2 + i / 100) for i in range(40)]
    trapped = [(0.02, 0.03, 1.0, 3, 0.05) for _ in range(30)]
    events = feed(EchoTrapDetector(EchoTrapConfig(window=10, reward_drop=0.5)), learning + trapped)
    assert events, "no warning on a collapse whose reward fell"
    first = events[0]
    assert first.kind == "collapse" and 40 < first.step <= 50
    # the rolling reward fell from its peak (0.545) by at least half the peak in-group std (0.45)
    assert first.details["reward_mean_peak"] - first.details["reward_mean"] >= 0.5 * 0.45
    assert "mean reward fell" in first.message


def test_a_small_dip_in_reward_is_not_a_collapse() -> None:
    # std and entropy collapsed, reward 0.1 below its peak: less than half the peak std (0.45)
    learning = [(0.45, 1.5 - i / 40, 1.0, 10, 0.2 + i / 100) for i in range(40)]
    dipped = [(0.02, 0.03, 1.0, 10, 0.49) for _ in range(60)]
    assert feed(EchoTrapDetector(), learning + dipped) == []


def test_fires_on_a_gradient_norm_spike() -> None:
    detector = EchoTrapDetector(EchoTrapConfig(spike_factor=10.0, spike_window=20))
    series = steady(30)
    assert feed(detector, series) == []
    events = detector.update(30, 0.4, 1.5, 25.0, 12)
    assert [e.kind for e in events] == ["grad_spike"]
    assert events[0].step == 30
    assert events[0].details["grad_norm"] == 25.0
    assert 0.6 <= events[0].details["grad_norm_median"] <= 1.4
    # 8x the median is below the factor: no event
    assert detector.update(31, 0.4, 1.5, 8.0, 12) == []


def test_non_finite_gradient_norm_fires_and_stays_out_of_the_median() -> None:
    detector = EchoTrapDetector()
    events = detector.update(0, 0.4, 1.5, float("nan"), 12)
    assert [e.kind for e in events] == ["grad_spike"]
    assert detector.state_dict()["grad_norm"] == []


def test_spike_needs_some_history() -> None:
    detector = EchoTrapDetector(EchoTrapConfig(spike_min_history=5))
    assert feed(detector, [(0.4, 1.5, g, 10) for g in (1.0, 1.0, 50.0)]) == []


def test_state_dict_round_trip_keeps_the_reference() -> None:
    detector = EchoTrapDetector()
    feed(detector, steady(40))
    restored = EchoTrapDetector()
    restored.load_state_dict(detector.state_dict())
    collapse = [(0.01, 0.05, 1.0, 3) for _ in range(15)]
    assert [e.to_dict() for e in feed(restored, collapse, 40)] == [
        e.to_dict() for e in feed(detector, collapse, 40)
    ]
    assert feed(EchoTrapDetector(), collapse, 40) == []  # without the restored peak: nothing to compare


def test_state_dict_round_trip_keeps_the_reward_peak() -> None:
    learning = [(0.45, 1.5 - i / 40, 1.0, 10, 0.2 + i / 100) for i in range(40)]
    detector = EchoTrapDetector()
    feed(detector, learning)
    restored = EchoTrapDetector()
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))  # state.json is JSON
    trapped = [(0.02, 0.03, 1.0, 3, 0.05) for _ in range(15)]
    assert feed(EchoTrapDetector(), trapped, 40) == []  # a fresh detector has no peak to fall from
    assert [e.to_dict() for e in feed(restored, trapped, 40)] == [
        e.to_dict() for e in feed(detector, trapped, 40)
    ]
    assert restored.state_dict()["peak_reward_mean"] == pytest.approx(0.545)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EchoTrapConfig(collapse_fraction=1.5)
    with pytest.raises(ValueError):
        EchoTrapConfig(spike_factor=0.5)
    with pytest.raises(ValueError):
        EchoTrapConfig(window=0)
    with pytest.raises(ValueError):
        EchoTrapConfig(reward_drop=-0.1)


def feed_signal(detector: EchoTrapDetector, shares, start: int = 0, reward_mean: float = -1.0):
    events = []
    for offset, share in enumerate(shares):
        events += detector.update(
            start + offset, 0.0, 1.5, 1.0, 10, groups_with_signal=share, reward_mean=reward_mean
        )
    return events


def test_no_signal_fires_after_its_window_of_flat_batches() -> None:
    detector = EchoTrapDetector(EchoTrapConfig(no_signal_window=5))
    assert feed_signal(detector, [0.0] * 4) == []
    (event,) = feed_signal(detector, [0.0], start=4)
    assert (event.kind, event.step) == ("no_signal", 4)
    assert event.details == {"updates": 5.0, "reward_mean": -1.0}
    assert "no learning signal" in event.message and "-1" in event.message


def test_no_signal_counts_updates_in_a_row() -> None:
    # one batch with a group that varied starts the count again
    assert (
        feed_signal(EchoTrapDetector(EchoTrapConfig(no_signal_window=5)), [0.0, 0.0, 0.0, 0.0, 0.1] * 10)
        == []
    )


def test_no_signal_repeats_after_the_cooldown_while_it_lasts() -> None:
    detector = EchoTrapDetector(EchoTrapConfig(no_signal_window=5, cooldown=10))
    events = feed_signal(detector, [0.0] * 30)
    assert [event.step for event in events] == [4, 14, 24]


def test_no_signal_is_not_judged_without_groups_to_compare() -> None:
    # one episode per group (a critic's baseline, not the group's): groups_with_signal is absent
    assert feed_signal(EchoTrapDetector(), [None] * 50) == []


def test_state_dict_keeps_the_flat_count() -> None:
    detector = EchoTrapDetector(EchoTrapConfig(no_signal_window=5))
    feed_signal(detector, [0.0] * 3)
    restored = EchoTrapDetector(EchoTrapConfig(no_signal_window=5))
    restored.load_state_dict(detector.state_dict())
    assert [event.step for event in feed_signal(restored, [0.0, 0.0], start=3)] == [4]
