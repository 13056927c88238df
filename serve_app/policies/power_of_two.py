"""power_of_two: sample two routable workers at random, take the less loaded (`least_loaded.load_of`)."""

from __future__ import annotations

import random
from typing import Sequence

from serve_app.policies.base import Decision, decision, RouteRequest, WorkerView, routable
from serve_app.policies.least_loaded import load_of


class PowerOfTwo:
    name = "power_of_two"

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        ok = routable(workers)
        if len(ok) == 1:
            only = ok[0]
            return decision(only, self.name, "only routable worker")
        a, b = rng.sample(ok, 2)
        la, lb = load_of(a), load_of(b)
        if la == lb:
            pick = a if rng.random() < 0.5 else b
        else:
            pick = a if la < lb else b
        other = b if pick is a else a
        return decision(pick, self.name,
                        ("load={:.3f} vs {}={:.3f}", min(la, lb), other.name, max(la, lb)))
