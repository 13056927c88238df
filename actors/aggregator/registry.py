"""The aggregator's soft state: workers, their latest metrics and liveness, versioned for followers.

Pure logic (no Ray, no sockets): the aggregator actor is a thin shell around `FleetRegistry`. Every
change bumps the registry version, stamps the changed worker with it and marks it dirty;
`take_delta()` hands the publisher exactly the workers changed since its last call (the name list
only when membership changed), `snapshot()` gives a follower that must resync the whole fleet.

Liveness comes from each worker actor's own reports: every report is that worker's heartbeat.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from actors.models import Settings, WorkerState, derive_state
from actors.protocol import (
    Adapter, FleetDelta, KvEventsStatus, ManagedEngine, MetricsUpdate, RankMetrics, WorkerReport, WorkerUpdate,
)


@dataclass(slots=True)
class _Worker:
    name: str
    url: str
    page_size: int
    incarnation: str
    healthy: bool
    health_detail: str
    heartbeat_at: float
    ranks: dict[int, tuple[RankMetrics, float]] = field(default_factory=dict)  # rank → (values, received at)
    managed: ManagedEngine | None = None
    kv_events_actor: str | None = None
    kv_events: KvEventsStatus | None = None
    models: list[str] = field(default_factory=list)
    role: str = "both"
    bootstrap_port: int | None = None
    dp_size: int = 1
    adapters: list[Adapter] = field(default_factory=list)
    state: WorkerState = WorkerState.IDLE
    version: int = 0
    metrics_at: float | None = None  # newest rank's receive time (registry clock)


BUSY_FRAMES = 8  # frames per publish_interval_s from which deltas go every publish_interval_s
MAX_REMOVED = 65_536  # removed workers whose late frames are recognised (oldest forgotten first)


def publish_wait_s(settings: Settings, drained: int, elapsed_s: float, changed: bool) -> float:
    """How long the aggregator sleeps after a wake-up that drained `drained` frames over the last
    `elapsed_s`: frames gather in the socket meanwhile. A fleet that changed something and sends
    at least `BUSY_FRAMES` frames per `publish_interval_s` is published every `publish_interval_s`
    (a delta of 100s of workers is worth a wake-up per window); a smaller one every `coalesce_s`
    (a wake-up here and in every follower per few reports is most of what a small fleet's plane
    costs); heartbeats that changed nothing are drained every 5 windows."""
    if not changed:
        return settings.publish_interval_s * 5
    many = drained >= BUSY_FRAMES * max(elapsed_s, 1e-3) / settings.publish_interval_s
    return settings.publish_interval_s if many else settings.coalesce_s


class FleetRegistry:
    """Workers reported by their actors. Methods return True when they changed something."""

    def __init__(self, settings: Settings | None = None, clock: Callable[[], float] = time.monotonic):
        self.settings = settings or Settings()
        self.clock = clock
        self.epoch = uuid.uuid4().hex[:12]  # a new registry (aggregator restart) = a new epoch
        self.version = 0
        self._workers: dict[str, _Worker] = {}
        self._in_flight: dict[str, tuple[float, dict[str, int]]] = {}  # router replica → counts
        self._next_due = float("inf")  # earliest moment a worker's state can change by time alone
        self._dirty: dict[str, bool] = {}  # changed since the last take_delta() → more than its ranks?
        self._published = 0  # version of the last take_delta()
        self._members_at = 0  # version of the last membership change
        self._replicas_at = 0  # version of the last change of the sharing router replicas
        # removed worker → the incarnation it had: that incarnation's frames still in flight (sent
        # before its actor stopped, drained after the removal) must not bring it back as a
        # worker that is down forever; another incarnation (the name added again) registers
        self._removed: dict[str, str] = {}
        self.late_reports = 0  # reports of a removed incarnation, ignored
        self._heard: set[str] = set()  # heartbeats that changed nothing since the last delta (`FleetDelta.heard`)

    # --- writes -------------------------------------------------------------------------------

    def report(self, r: WorkerReport) -> bool:
        """Upsert one worker's report (registration, liveness and latest ranks in one)."""
        now = self.clock()
        w = self._workers.get(r.name)
        changed = False  # anything but the ranks
        if w is None and self._removed:
            if self._removed.get(r.name) == r.incarnation:
                self.late_reports += 1
                return False
            self._removed.pop(r.name, None)
        if w is None or w.incarnation != r.incarnation:
            if w is None:
                self._members_at = self.version + 1
            w = _Worker(name=r.name, url=r.url, page_size=r.page_size, incarnation=r.incarnation,
                        healthy=r.healthy, health_detail=r.health_detail, heartbeat_at=now)
            self._workers[r.name] = w
            changed = True
        w.heartbeat_at = now
        if w.url != r.url or w.page_size != r.page_size or w.healthy != r.healthy \
                or w.health_detail != r.health_detail or w.managed != r.managed \
                or w.kv_events_actor != r.kv_events_actor or w.kv_events != r.kv_events or w.models != r.models \
                or w.role != r.role or w.bootstrap_port != r.bootstrap_port or w.dp_size != r.dp_size \
                or w.adapters != r.adapters:
            w.url, w.page_size, w.healthy, w.health_detail = r.url, r.page_size, r.healthy, r.health_detail
            w.managed, w.kv_events_actor, w.kv_events = r.managed, r.kv_events_actor, r.kv_events
            w.models, w.dp_size, w.adapters = r.models, r.dp_size, r.adapters
            w.role, w.bootstrap_port = r.role, r.bootstrap_port
            changed = True
        ranks_changed = False
        for m in r.ranks:
            old = w.ranks.get(m.data_parallel_rank)
            if old is None or old[0].seq != m.seq:
                at = now - m.age_s
                w.ranks[m.data_parallel_rank] = (m, at)
                if w.metrics_at is None or at > w.metrics_at:
                    w.metrics_at = at
                ranks_changed = True
        changed |= self._rederive(w, now)
        if changed or ranks_changed:
            self._bump(w, whole=changed)
        else:
            self._heard.add(w.name)
        due = self._due(w, now)
        if due < self._next_due:
            self._next_due = due
        return changed or ranks_changed

    def remove(self, name: str) -> bool:
        """Forget a worker. Reports of the incarnation it had are ignored from now on (frames
        already in flight when its actor stopped); a new incarnation registers it again."""
        w = self._workers.pop(name, None)
        if w is None:
            return False
        self._removed[name] = w.incarnation
        if len(self._removed) > MAX_REMOVED:  # bounded: forget the oldest
            del self._removed[next(iter(self._removed))]
        self.version += 1
        self._members_at = self.version
        self._dirty.pop(name, None)
        return True

    def report_in_flight(self, replica: str, counts: dict[str, int]) -> bool:
        """A router replica's in-flight counts per worker, shared so replicas don't herd."""
        now = self.clock()
        old = self._in_flight.get(replica)
        self._in_flight[replica] = (now, dict(counts))
        if old is None:  # a replica arrived: followers learn it (`FleetDelta.replicas`)
            self.version += 1
            self._replicas_at = self.version
        elif old[1] == counts:
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
                self.version += 1
                self._replicas_at = self.version
                changed = True
        return changed

    def next_due(self) -> float:
        """The earliest moment `tick()` can change something (registry clock; never later than the
        true one): a worker's idle or down threshold, a router replica's in-flight counts expiring.
        O(replicas)."""
        due = self._next_due
        expiry = self.settings.down_after_s * 2
        for at, _ in self._in_flight.values():
            if at + expiry < due:
                due = at + expiry
        return due

    # --- reads --------------------------------------------------------------------------------

    def snapshot(self) -> FleetDelta:
        """The whole fleet now, for a follower that starts or must resync."""
        now = self.clock()
        return FleetDelta(epoch=self.epoch, version=self.version, prev_version=0, full=True,
                          workers=[self._public(w, now) for w in self._workers.values()], names=list(self._workers),
                          replicas=list(self._in_flight))

    def take_delta(self) -> FleetDelta | None:
        """Workers changed since the previous call (None if nothing did): what the publisher sends."""
        if self.version == self._published:
            return None
        now = self.clock()
        workers = self._workers
        whole, ranks_only = [], []
        for n, more in self._dirty.items():
            w = workers.get(n)
            if w is None:
                continue
            if more:
                whole.append(self._public(w, now))
            else:
                ranks_only.append(MetricsUpdate(n, max(0.0, now - w.metrics_at), self._ranks(w), w.version))
        names = list(workers) if self._members_at > self._published else None
        replicas = list(self._in_flight) if self._replicas_at > self._published else None
        delta = FleetDelta(epoch=self.epoch, version=self.version, prev_version=self._published, full=False,
                           workers=whole, names=names, metrics=ranks_only, replicas=replicas, heard=self._take_heard())
        self._published = self.version
        self._dirty.clear()
        return delta

    def keepalive(self) -> FleetDelta:
        """An empty delta at the last published version: followers hear the epoch, that we live, and
        which workers' heartbeats arrived meanwhile."""
        return FleetDelta(epoch=self.epoch, version=self._published, prev_version=self._published, full=False,
                          workers=[], heard=self._take_heard())

    def _take_heard(self) -> list[str]:
        heard = [n for n in self._heard if n in self._workers and n not in self._dirty]
        self._heard.clear()
        return heard

    def names(self) -> list[str]:
        return list(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def _public(self, w: _Worker, now: float) -> WorkerUpdate:
        remote = {replica: counts[w.name] for replica, (_, counts) in self._in_flight.items() if w.name in counts} \
            if self._in_flight else {}
        return WorkerUpdate(
            name=w.name, url=w.url, page_size=w.page_size, state=w.state.value, healthy=w.healthy,
            health_detail=w.health_detail,
            metrics_age_s=None if w.metrics_at is None else max(0.0, now - w.metrics_at),
            heartbeat_age_s=max(0.0, now - w.heartbeat_at),
            ranks=self._ranks(w), in_flight_by_replica=remote, version=w.version,
            managed=w.managed, kv_events_actor=w.kv_events_actor, kv_events=w.kv_events, models=w.models,
            role=w.role, bootstrap_port=w.bootstrap_port, dp_size=w.dp_size, adapters=w.adapters,
        )

    @staticmethod
    def _ranks(w: _Worker) -> list[RankMetrics]:
        if len(w.ranks) == 1:
            return [m for m, _ in w.ranks.values()]
        return [m for _, (m, _) in sorted(w.ranks.items())]

    # --- internals ----------------------------------------------------------------------------

    @staticmethod
    def _metrics_age(w: _Worker, now: float) -> float | None:
        return None if w.metrics_at is None else now - w.metrics_at

    def _due(self, w: _Worker, now: float) -> float:
        """When `w`'s derived state can next change without a report: its heartbeat reaching
        `down_after_s` or its newest metrics reaching `idle_after_s` (thresholds already passed are reflected in its
        state)."""
        s = self.settings
        due = w.heartbeat_at + s.down_after_s
        if due < now:
            due = float("inf")
        if w.metrics_at is not None:
            idle = w.metrics_at + s.idle_after_s
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

    def _bump(self, w: _Worker, whole: bool = True) -> None:
        """A new version for `w`; `whole=False`: only its ranks changed (published as a MetricsUpdate)."""
        self.version += 1
        w.version = self.version
        self._dirty[w.name] = whole or self._dirty.get(w.name, False)
