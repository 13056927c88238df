"""The aggregator's soft state: workers, their latest metrics and liveness, versioned for long polls.

Pure logic (no Ray): the aggregator actor is a thin shell around `FleetRegistry`. Every change
bumps the registry version and stamps the changed worker with it, so a follower asking
`delta(since)` gets exactly the workers that changed, plus the full name list to notice removals.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.models import KV_METRICS_FIELDS, Settings, WorkerState, derive_state, sum_ranks


@dataclass(slots=True)
class _Rank:
    values: dict[str, Any]  # the 8 KvMetrics fields, token counts as sent
    received_at: float  # registry clock
    seq: int


@dataclass(slots=True)
class _Worker:
    name: str
    url: str
    page_size: int
    incarnation: str
    healthy: bool
    health_detail: str
    heartbeat_at: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. managed-process status
    state: WorkerState = WorkerState.IDLE
    version: int = 0


class FleetRegistry:
    """Workers reported by their actors. Methods return True when they changed something."""

    def __init__(self, settings: Settings | None = None, clock: Callable[[], float] = time.monotonic):
        self.settings = settings or Settings()
        self.clock = clock
        self.epoch = uuid.uuid4().hex[:12]  # a new registry (aggregator restart) = a new epoch
        self.version = 0
        self._workers: dict[str, _Worker] = {}
        self._removed_at: dict[str, int] = {}
        self._in_flight: dict[str, tuple[float, dict[str, int]]] = {}  # router replica → counts
        self._next_due = float("inf")  # earliest moment a worker's state can change by time alone

    # --- writes -------------------------------------------------------------------------------

    def report(self, batch: dict[str, Any]) -> bool:
        """Upsert one worker actor's report (registration, liveness and latest ranks in one).

        `batch`: name, url, page_size, incarnation, healthy, health_detail, extra,
        ranks: {rank: {**8 fields, "age_s": float, "seq": int}}.
        """
        now = self.clock()
        name = batch["name"]
        w = self._workers.get(name)
        changed = False
        if w is None or w.incarnation != batch["incarnation"]:
            w = _Worker(
                name=name,
                url=batch["url"],
                page_size=int(batch.get("page_size", 1)),
                incarnation=batch["incarnation"],
                healthy=bool(batch["healthy"]),
                health_detail=str(batch.get("health_detail", "")),
                heartbeat_at=now,
            )
            self._workers[name] = w
            self._removed_at.pop(name, None)
            changed = True
        w.heartbeat_at = now
        for attr in ("url", "page_size", "healthy", "health_detail", "extra"):
            if attr in batch and getattr(w, attr) != batch[attr]:
                setattr(w, attr, batch[attr])
                changed = True
        for rank_key, r in (batch.get("ranks") or {}).items():
            rank = int(rank_key)
            old = w.ranks.get(rank)
            if old is None or old.seq != r["seq"]:
                w.ranks[rank] = _Rank(
                    values={f: r[f] for f in KV_METRICS_FIELDS},
                    received_at=now - max(0.0, float(r.get("age_s", 0.0))),
                    seq=int(r["seq"]),
                )
                changed = True
        changed |= self._rederive(w, now)
        if changed:
            self._bump(w)
        self._next_due = min(self._next_due, self._due(w, now))
        return changed

    def remove(self, name: str) -> bool:
        if self._workers.pop(name, None) is None:
            return False
        self.version += 1
        self._removed_at[name] = self.version
        return True

    def report_in_flight(self, replica: str, counts: dict[str, int]) -> bool:
        """A router replica's in-flight counts per worker, shared so replicas don't herd."""
        now = self.clock()
        old = self._in_flight.get(replica)
        self._in_flight[replica] = (now, dict(counts))
        if old is not None and old[1] == counts:
            return False
        for name in set(counts) | set(old[1] if old else {}):
            if name in self._workers:
                self._bump(self._workers[name])
        return True

    def tick(self) -> bool:
        """Re-derive time-driven states (idle after silence, down after lost heartbeats)."""
        now = self.clock()
        changed = False
        if now >= self._next_due:  # else no threshold can have passed: skip the O(workers) pass
            due = float("inf")
            for w in self._workers.values():
                if self._rederive(w, now):
                    self._bump(w)
                    changed = True
                due = min(due, self._due(w, now))
            self._next_due = due
        expiry = self.settings.down_after_s * 2
        for replica, (at, counts) in list(self._in_flight.items()):
            if now - at > expiry:
                del self._in_flight[replica]
                for name in counts:
                    if name in self._workers:
                        self._bump(self._workers[name])
                changed = True
        return changed

    # --- reads --------------------------------------------------------------------------------

    def delta(self, since_version: int, epoch: str | None) -> dict[str, Any]:
        """Workers changed after `since_version` (all of them if `epoch` is not ours)."""
        now = self.clock()
        full = epoch != self.epoch or since_version <= 0
        workers = [
            self._public(w, now)
            for w in self._workers.values()
            if full or w.version > since_version
        ]
        return {
            "epoch": self.epoch,
            "version": self.version,
            "full": full,
            "names": list(self._workers),
            "workers": workers,
        }

    def names(self) -> list[str]:
        return list(self._workers)

    def _public(self, w: _Worker, now: float) -> dict[str, Any]:
        ranks = [dict(r.values) for _, r in sorted(w.ranks.items())]
        metrics_age = self._metrics_age(w, now)
        remote = {
            replica: counts[w.name] for replica, (_, counts) in self._in_flight.items() if w.name in counts
        }
        return {
            "name": w.name,
            "url": w.url,
            "page_size": w.page_size,
            "state": w.state.value,
            "healthy": w.healthy,
            "health_detail": w.health_detail,
            "metrics_age_s": metrics_age,
            "heartbeat_age_s": now - w.heartbeat_at,
            "metrics": sum_ranks(ranks),
            "ranks": ranks,
            "in_flight_by_replica": remote,
            "extra": dict(w.extra),
            "version": w.version,
        }

    # --- internals ----------------------------------------------------------------------------

    @staticmethod
    def _metrics_age(w: _Worker, now: float) -> float | None:
        if not w.ranks:
            return None
        return now - max(r.received_at for r in w.ranks.values())

    def _due(self, w: _Worker, now: float) -> float:
        """When `w`'s derived state can next change without a report: its heartbeat reaching
        `down_after_s` or its newest metrics reaching `idle_after_s` (thresholds already passed
        are reflected in its state)."""
        s = self.settings
        due = w.heartbeat_at + s.down_after_s
        if due < now:
            due = float("inf")
        if w.ranks:
            idle = max(r.received_at for r in w.ranks.values()) + s.idle_after_s
            if now <= idle < due:
                due = idle
        return due

    def _rederive(self, w: _Worker, now: float) -> bool:
        state = derive_state(
            healthy=w.healthy,
            heartbeat_age_s=now - w.heartbeat_at,
            metrics_age_s=self._metrics_age(w, now),
            settings=self.settings,
        )
        if state is w.state:
            return False
        w.state = state
        return True

    def _bump(self, w: _Worker) -> None:
        self.version += 1
        w.version = self.version
