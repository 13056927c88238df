"""least_loaded: the worker with the fewest outstanding requests, counting the router's own dispatches."""

from __future__ import annotations

import random
from typing import Sequence

from serve_app.policies.base import Decision, decision, RouteRequest, WorkerView, _Argmin, routable


def load_of(w: WorkerView) -> float:
    """Outstanding requests: reported running + waiting, plus dispatches the report cannot show yet
    (this replica's and other replicas'); the KV use fraction (in [0, 1]) breaks ties between
    workers with equal counts. `idle` workers arrive with reported figures zeroed."""
    kv = w.kv_active_blocks / w.kv_total_blocks if w.kv_total_blocks else 0.0
    return w.running + w.waiting + w.pending + w.remote_pending + kv


class LeastLoaded:
    name = "least_loaded"

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        best = _Argmin()
        for w in routable(workers):
            best.add(load_of(w), w)
        pick = best.items[0] if len(best.items) == 1 else rng.choice(best.items)
        return decision(pick, self.name, ("load={:.3f} among {} tied", best.best, len(best.items)))
