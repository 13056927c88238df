"""The fleet-wide coalescing window: how long a metrics host may hold a change before its frame goes,
decided by the aggregator for every host from the whole fleet's load. Pure logic (no Ray, no sockets).

A host cannot tell a small busy fleet from a large one by its own traffic (four busy workers on one
host and eight workers of a 1,000-worker fleet send it about as many changes per window), but the
aggregator can, and the two want different windows:

- **small fleet**: every host window is an aggregator wake-up, a delta and a wake-up in every router
  replica, ~1 ms of CPU in all; that is what a small fleet's plane costs, so hosts coalesce over
  `coalesce_s` (the aggregator publishes their frames at once: one wait, not two);
- **large fleet** (the aggregator takes at least `BUSY_FRAMES` changed reports per
  `publish_interval_s`, 800/s at the defaults — the load at which it publishes every
  `publish_interval_s` anyway): followers wake every `publish_interval_s` whatever the hosts do, so a
  shorter host window costs only the host's own node its wake-ups and the aggregator a few more frames
  per drain, not more wake-ups — while a change waits for two stages, its host's window and then the
  aggregator's publication. Hosts then coalesce over `fleet_window_s`: a change waits ≤
  `fleet_window_s` + `publish_interval_s` (20 ms at the defaults) in the plane. The price is the
  hosts' own wake-ups on their nodes (measured in bench/results/scale.md).

The rate is measured over `PERIOD_S`; the fleet is large from `BUSY_FRAMES / publish_interval_s`
changed reports per second and small again below half of it (no flapping at the edge).
"""

from __future__ import annotations

from actors.models import Settings
from actors.registry import BUSY_FRAMES  # the aggregator's own busy pace: the same threshold, in reports

PERIOD_S = 1.0  # the report rate is measured over this long


class FleetWindow:
    """Feed it the aggregator's running count of reports (`observe`); `window_s` is the window hosts
    should use now, `large` which regime the fleet is in."""

    def __init__(self, settings: Settings, now: float) -> None:
        self.settings = settings
        self.enter_per_s = BUSY_FRAMES / settings.publish_interval_s
        self.leave_per_s = self.enter_per_s / 2
        self.large = False
        self.rate = 0.0  # changed reports per second over the last full period
        self._t0 = now
        self._n0: int | None = None

    @property
    def window_s(self) -> float:
        s = self.settings
        return min(s.fleet_window_s, s.coalesce_s) if self.large else s.coalesce_s

    def observe(self, reports: int, now: float) -> bool:
        """`reports`: the aggregator's count of reports taken so far (monotonic). True when the window
        changed (hosts must hear of it)."""
        if self._n0 is None or reports < self._n0:  # first call, or a counter reset
            self._t0, self._n0 = now, reports
            return False
        elapsed = now - self._t0
        if elapsed < PERIOD_S:
            return False
        self.rate = (reports - self._n0) / elapsed
        self._t0, self._n0 = now, reports
        before = self.window_s
        if not self.large and self.rate >= self.enter_per_s:
            self.large = True
        elif self.large and self.rate < self.leave_per_s:
            self.large = False
        return self.window_s != before
