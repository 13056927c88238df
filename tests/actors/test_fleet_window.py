"""actors.fleet_window.FleetWindow: the window the aggregator hands every metrics host, from the fleet's
report rate. Pure logic, a fake clock."""

from __future__ import annotations

import pytest

from actors.fleet_window import PERIOD_S, FleetWindow
from actors.models import Settings


def _feed(fw: FleetWindow, per_s: float, seconds: float, start: tuple[float, int]) -> tuple[float, int, list[bool]]:
    """Observe `per_s` reports per second for `seconds` in 10 ms steps; returns (now, count, changes)."""
    now, n = start
    changes = []
    for _ in range(int(seconds / 0.01)):
        now += 0.01
        n += int(round(per_s * 0.01))
        changes.append(fw.observe(n, now))
    return now, n, changes


def test_a_small_busy_fleet_keeps_coalesce_s():
    s = Settings()
    fw = FleetWindow(s, 0.0)
    # 4 busy workers hosted together: ~4 reports per 50 ms window, 80/s
    _, _, changes = _feed(fw, 80, 5.0, (0.0, 0))
    assert not any(changes)
    assert not fw.large and fw.window_s == s.coalesce_s
    assert fw.rate == pytest.approx(100, abs=30)  # (rounded per 10 ms step: 1 report)


def test_a_large_fleet_gets_fleet_window_s_within_two_periods_and_says_so_once():
    s = Settings()
    fw = FleetWindow(s, 0.0)
    # 1,000 workers x 10 Hz: 10,000 changed reports/s
    _, _, changes = _feed(fw, 10_000, 2 * PERIOD_S + 0.05, (0.0, 0))
    assert changes.count(True) == 1
    assert fw.large and fw.window_s == s.fleet_window_s < s.coalesce_s


def test_the_threshold_is_the_aggregators_busy_pace_with_hysteresis():
    s = Settings(publish_interval_s=0.01)
    fw = FleetWindow(s, 0.0)
    assert fw.enter_per_s == 800 and fw.leave_per_s == 400
    now, n, _ = _feed(fw, 700, 3.0, (0.0, 0))
    assert not fw.large
    now, n, _ = _feed(fw, 900, 3.0, (now, n))
    assert fw.large
    now, n, _ = _feed(fw, 500, 3.0, (now, n))  # between the two thresholds: stays large (no flapping)
    assert fw.large
    now, n, changes = _feed(fw, 300, 3.0, (now, n))
    assert not fw.large and fw.window_s == s.coalesce_s and changes.count(True) == 1


def test_a_fleet_that_goes_silent_is_small_within_two_periods():
    s = Settings()
    fw = FleetWindow(s, 0.0)
    now, n, _ = _feed(fw, 5_000, 3.0, (0.0, 0))
    assert fw.large
    # the aggregator's quiet loop observes at least every heartbeat_s; nothing arrives any more
    changed = [fw.observe(n, now + k * s.heartbeat_s) for k in range(1, int(2 * PERIOD_S / s.heartbeat_s) + 2)]
    assert changed.count(True) == 1
    assert not fw.large and fw.window_s == s.coalesce_s


def test_the_fleet_window_is_never_longer_than_coalesce_s():
    s = Settings(coalesce_s=0.01, fleet_window_s=0.05)
    fw = FleetWindow(s, 0.0)
    _feed(fw, 10_000, 3.0, (0.0, 0))
    assert fw.large and fw.window_s == 0.01
