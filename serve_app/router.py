"""The decision plane of one router replica: fleet view + in-flight ledger + prefix index → policy.

No Serve and no HTTP here; `serve_app.app` is the thin HTTP shell around `RouterCore`.
"""

from __future__ import annotations

import random
import time
from typing import Any

from actors.models import KV_METRICS_FIELDS
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.ledger import Ledger
from serve_app.policies import DEFAULT_POLICY, POLICIES, Decision, RouteRequest, WorkerView, get_policy
from serve_app.prefix_index import PrefixIndex


class RouterCore:
    def __init__(self, config: RouterConfig, follower: FleetFollower, replica_id: str) -> None:
        self.config = config
        self.follower = follower
        self.replica_id = replica_id
        self.rng = random.Random(config.seed)
        self.ledger = Ledger()
        self.prefix = PrefixIndex()
        self.default_policy = config.policy
        get_policy(self.default_policy)  # unknown default → error at start, not per request
        self._policies = {name: get_policy(name) for name in POLICIES}
        follower.on_update = self._on_fleet_update

    # --- fleet view ---------------------------------------------------------------------------

    def _on_fleet_update(self, changed: list[str]) -> None:
        now = time.monotonic()
        for name in changed:
            rec = self.follower.workers.get(name)
            if rec is None:
                self.ledger.remove_worker(name)
                self.prefix.remove_worker(name)
            elif rec.metrics_at is not None:
                self.ledger.on_report(name, rec.metrics_at)
            if rec is not None and rec.state == "down":
                pass  # keep index entries: a worker that comes back usually kept its cache
        del now

    def remote_in_flight(self, rec: WorkerRecord) -> int:
        return sum(n for replica, n in rec.in_flight_by_replica.items() if replica != self.replica_id)

    def views(self, overlap: dict[str, int] | None = None) -> list[WorkerView]:
        out: list[WorkerView] = []
        for rec in self.follower.workers.values():
            m = rec.metrics if rec.state == "live" else None  # idle: the last report is not load
            lv = self.ledger.view(rec.name)
            out.append(
                WorkerView(
                    name=rec.name,
                    url=rec.url,
                    state=rec.state,
                    page_size=rec.page_size,
                    running=m["request_active_slots"] if m else 0,
                    total_slots=(rec.metrics or {}).get("request_total_slots", 0) or 0,
                    waiting=m["num_requests_waiting"] if m else 0,
                    kv_active_blocks=m["kv_active_blocks"] if m else 0,
                    kv_total_blocks=(rec.metrics or {}).get("kv_total_blocks", 0) or 0,
                    in_flight=lv.in_flight + self.remote_in_flight(rec),
                    **self._extra_view_fields(rec.name, lv, overlap),
                )
            )
        return out

    def _extra_view_fields(self, name: str, lv: Any, overlap: dict[str, int] | None) -> dict[str, Any]:
        fields = WorkerView.__dataclass_fields__
        extra: dict[str, Any] = {}
        if "overlap_blocks" in fields:
            extra["overlap_blocks"] = (overlap or {}).get(name, 0)
        for f in ("pending_prefill_blocks", "decode_blocks", "unreported"):
            if f in fields and hasattr(lv, f):
                extra[f] = getattr(lv, f)
        return extra

    # --- decisions ----------------------------------------------------------------------------

    def policy(self, name: str | None) -> Any:
        name = name or self.default_policy
        p = self._policies.get(name)
        if p is None:
            get_policy(name)  # raises UnknownPolicy listing the valid names
        return p

    def decide(
        self, request: RouteRequest, policy_name: str | None = None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> Decision:
        """Pick a worker (never one in `exclude`, e.g. already failed for this request)."""
        policy = self.policy(policy_name)
        overlap = self.prefix.overlap(request.block_hashes) if request.block_hashes else {}
        views = [v for v in self.views(overlap) if v.name not in exclude]
        return policy.choose(request, views, self.rng)

    # --- public views -------------------------------------------------------------------------

    def workers_json(self) -> dict[str, Any]:
        now = time.monotonic()
        workers = []
        for rec in sorted(self.follower.workers.values(), key=lambda r: r.name):
            lv = self.ledger.view(rec.name)
            workers.append(
                {
                    "name": rec.name,
                    "url": rec.url,
                    "state": rec.state,
                    "healthy": rec.healthy,
                    "health_detail": rec.health_detail,
                    "page_size": rec.page_size,
                    "metrics_age_s": None if rec.metrics_at is None else round(now - rec.metrics_at, 4),
                    "heartbeat_age_s": round(now - rec.heartbeat_at, 4),
                    "metrics": {f: rec.metrics[f] for f in KV_METRICS_FIELDS} if rec.metrics else None,
                    "ranks": rec.ranks,
                    "in_flight": lv.in_flight + self.remote_in_flight(rec),
                    "in_flight_local": lv.in_flight,
                    "updated_at": rec.updated_at,
                    "managed": rec.extra or None,
                }
            )
        return {"version": self.follower.version, "epoch": self.follower.epoch, "workers": workers}

    def healthz(self) -> dict[str, Any]:
        f = self.follower
        age = f.snapshot_age_s()
        states: dict[str, int] = {}
        for rec in f.workers.values():
            states[rec.state] = states.get(rec.state, 0) + 1
        routable = states.get("live", 0) + states.get("idle", 0)
        status = "ok" if f.connected and routable else ("degraded" if routable else "unavailable")
        return {
            "status": status,
            "aggregator": "reachable" if f.connected else "unreachable",
            "aggregator_error": f.last_error,
            "snapshot_age_s": None if age is None else round(age, 3),
            "snapshot_version": f.version,
            "workers": states,
            "replica": self.replica_id,
            "default_policy": self.default_policy,
        }
