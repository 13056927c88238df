"""Routing policies by name: each a pure function of (request, fleet view) behind one interface."""

from __future__ import annotations

from serve_app.policies.base import (
    Decision,
    NoWorkerAvailable,
    Policy,
    RouteRequest,
    WorkerView,
)
from serve_app.policies.least_loaded import LeastLoaded

POLICIES: dict[str, type] = {
    LeastLoaded.name: LeastLoaded,
}
DEFAULT_POLICY = "least_loaded"


class UnknownPolicy(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown policy {name!r}; valid: {', '.join(sorted(POLICIES))}")
        self.name = name


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise UnknownPolicy(name) from None


__all__ = [
    "Decision", "NoWorkerAvailable", "Policy", "RouteRequest", "WorkerView",
    "POLICIES", "DEFAULT_POLICY", "UnknownPolicy", "get_policy",
]
