"""random: a uniformly random routable worker (the baseline every other policy must beat)."""

from __future__ import annotations

import random
from typing import Sequence

from serve_app.policies.base import Decision, decision, RouteRequest, WorkerView, routable


class RandomChoice:
    name = "random"

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        ok = routable(workers)
        pick = rng.choice(ok)
        return decision(pick, self.name, f"uniform among {len(ok)}")
