"""round_robin: the next routable worker in fleet order, skipping `down` ones."""

from __future__ import annotations

import random
from typing import Sequence

from serve_app.policies.base import Decision, decision, RouteRequest, WorkerView, routable


class RoundRobin:
    """Cycles through the routable workers in the order given. The counter is the only state of
    any policy; the router keeps one instance per policy name, so the cycle spans requests."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        ok = routable(workers)
        i = self._next % len(ok)
        self._next = i + 1
        pick = ok[i]
        return decision(pick, self.name, f"turn {i + 1}/{len(ok)}")
