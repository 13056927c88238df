"""Per-worker circuit breakers: stop sending to a worker after consecutive failures, probe it again later.

Pure logic (no I/O): the router calls `allow` when choosing, `on_success` / `on_failure` with each
upstream outcome. Closed → (N consecutive failures) → open for `open_s` → half-open: one request
at a time is let through as a probe; its success closes the breaker, its failure re-opens it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_CODE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a worker's breaker opens and for how long (`router.breaker` in the config tree)."""

    failures_to_open: int = 3
    """Consecutive upstream failures (refused connection, 5xx before the first byte, a stream
    broken mid-way) that open a worker's breaker; connect timeouts never count."""
    open_s: float = 5.0
    """Seconds an open breaker keeps requests away from its worker before one probe is let through."""

    def __post_init__(self) -> None:
        if self.failures_to_open < 1:
            raise ValueError(f"failures_to_open must be ≥ 1, got {self.failures_to_open}")
        if not self.open_s > 0:
            raise ValueError(f"open_s must be > 0, got {self.open_s}")


@dataclass(slots=True)
class _State:
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False


class Breakers:
    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or BreakerConfig()
        self.clock = clock
        self._s: dict[str, _State] = {}

    def state(self, worker: str) -> str:
        s = self._s.get(worker)
        if s is None:
            return CLOSED
        if s.state == OPEN and self.clock() - s.opened_at >= self.config.open_s:
            s.state, s.probing = HALF_OPEN, False
        return s.state

    def blocked(self) -> set[str]:
        """Workers a request must not be sent to right now (open, or half-open with a probe out)."""
        return {w for w in list(self._s) if self.state(w) == OPEN or (self.state(w) == HALF_OPEN and self._s[w].probing)}

    def on_dispatch(self, worker: str) -> None:
        """A request goes to `worker`; in half-open it is the one probe."""
        s = self._s.get(worker)
        if s is not None and self.state(worker) == HALF_OPEN:
            s.probing = True

    def on_success(self, worker: str) -> None:
        s = self._s.get(worker)
        if s is not None:
            s.state, s.failures, s.probing = CLOSED, 0, False

    def on_failure(self, worker: str) -> bool:
        """Record a failure; True if this opened (or re-opened) the breaker."""
        s = self._s.setdefault(worker, _State())
        s.failures += 1
        if s.state == HALF_OPEN or (s.state == CLOSED and s.failures >= self.config.failures_to_open):
            s.state, s.opened_at, s.probing = OPEN, self.clock(), False
            return True
        return False

    def states(self) -> dict[str, str]:
        return {w: self.state(w) for w in list(self._s)}

    def forget(self, worker: str) -> None:
        self._s.pop(worker, None)
