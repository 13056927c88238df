"""least_loaded: the worker with the least queued, running and KV load, counting own in-flight."""

from __future__ import annotations

import random
from typing import Sequence

from serve_app.policies.base import Decision, RouteRequest, WorkerView, _Argmin, routable


def load_of(w: WorkerView) -> float:
    """Load in "requests": waiting + in-flight dominate, then slot use, then KV use (each in [0,1])."""
    slots = (w.running + w.in_flight) / w.total_slots if w.total_slots else 0.0
    kv = w.kv_active_blocks / w.kv_total_blocks if w.kv_total_blocks else 0.0
    return w.waiting + w.in_flight + slots + kv


class LeastLoaded:
    name = "least_loaded"

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        best = _Argmin()
        for w in routable(workers):
            best.add(load_of(w), w)
        pick = rng.choice(best.items)
        return Decision(
            pick.name, pick.url, self.name, f"load={best.best:.3f} among {len(best.items)} tied"
        )
