"""Routing policies by name: each a pure function of (request, fleet view) behind one interface."""

from __future__ import annotations

from serve_app.policies.base import (
    Decision,
    NoWorkerAvailable,
    Policy,
    RouteRequest,
    WorkerView,
    routable,
)
from serve_app.policies.kv_aware import KvAware, KvAwareConfig
from serve_app.policies.least_loaded import LeastLoaded
from serve_app.policies.power_of_two import PowerOfTwo
from serve_app.policies.random_choice import RandomChoice
from serve_app.policies.round_robin import RoundRobin

POLICIES: dict[str, type] = {
    p.name: p for p in (RoundRobin, RandomChoice, PowerOfTwo, LeastLoaded, KvAware)
}
DEFAULT_POLICY = "kv_aware"


class UnknownPolicy(ValueError):
    def __init__(self, name: str) -> None:
        import difflib

        close = difflib.get_close_matches(str(name), POLICIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        super().__init__(f"unknown policy {name!r}{hint}; valid: {', '.join(sorted(POLICIES))}")
        self.name = name


def get_policy(name: str) -> Policy:
    """A fresh instance of the named policy (keep one per name: round_robin's cycle lives on it)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise UnknownPolicy(name) from None


__all__ = [
    "Decision", "NoWorkerAvailable", "Policy", "RouteRequest", "WorkerView", "routable",
    "KvAware", "KvAwareConfig", "POLICIES", "DEFAULT_POLICY", "UnknownPolicy", "get_policy",
]
