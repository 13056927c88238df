"""What every routing policy sees and returns: the request, the fleet view, the decision."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it at decision time (snapshot + its own ledger).

    Reported figures are already zeroed for `idle` workers (their last report is not load);
    `kv_*_blocks` are in blocks of the worker's `page_size`.
    """

    name: str
    url: str
    state: str  # "live" | "idle" | "down"
    page_size: int = 1
    running: int = 0  # reported request_active_slots
    total_slots: int = 0  # reported request_total_slots (0 = unknown)
    waiting: int = 0  # reported num_requests_waiting
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    in_flight: int = 0  # dispatched by the router and not yet finished


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The routing-relevant facts of one request, extracted once from its body."""

    prompt: str = ""  # the whole prompt as the engine sees it (all chat messages, in order)
    prompt_tokens: int = 0  # estimate
    max_tokens: int = 0
    block_hashes: tuple[int, ...] = ()  # chained hashes of page-sized prompt blocks


@dataclass(frozen=True, slots=True)
class Decision:
    worker: str
    url: str
    policy: str
    reason: str


class NoWorkerAvailable(RuntimeError):
    """No worker can take the request (all down, or none registered)."""


class Policy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision: ...


def routable(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers a policy may pick: never `down`. Raises NoWorkerAvailable when none is left."""
    out = [w for w in workers if w.state != "down"]
    if not out:
        states = ", ".join(f"{w.name}={w.state}" for w in workers) or "no workers registered"
        raise NoWorkerAvailable(f"no routable worker ({states})")
    return out


@dataclass(slots=True)
class _Argmin:
    """Keeps the cheapest candidates; ties broken uniformly at random by the caller's rng."""

    best: float = float("inf")
    items: list[WorkerView] = field(default_factory=list)

    def add(self, cost: float, w: WorkerView, eps: float = 1e-9) -> None:
        if cost < self.best - eps:
            self.best, self.items = cost, [w]
        elif cost <= self.best + eps:
            self.items.append(w)
