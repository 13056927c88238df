"""Keeps a router replica's local copy of the aggregator's fleet view, by long poll, off the
request path: requests read `FleetFollower.workers`, never wait on an actor call."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

logger = logging.getLogger("kvroute.follower")


@dataclass(slots=True)
class WorkerRecord:
    """One worker as last reported, with ages turned into this replica's monotonic clock."""

    name: str
    url: str
    page_size: int
    state: str
    healthy: bool
    health_detail: str
    metrics: dict[str, Any] | None
    ranks: list[dict[str, Any]]
    metrics_at: float | None  # local monotonic time of the newest frame (None: never reported)
    heartbeat_at: float
    updated_at: float  # wall clock when this replica applied the record (freshness measurements)
    in_flight_by_replica: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class FleetFollower:
    """Applies aggregator deltas; survives the aggregator restarting (epoch change → full resync)
    and being unreachable (keeps the last view; `health()` reports the staleness)."""

    def __init__(
        self,
        resolve: Callable[[], Awaitable[Any]],
        *,
        poll_timeout_s: float = 5.0,
        backoff_s: float = 0.1,
        backoff_max_s: float = 0.5,
        on_update: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._resolve = resolve
        self.poll_timeout_s = poll_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.on_update = on_update
        self.workers: dict[str, WorkerRecord] = {}
        self.epoch: str | None = None
        self.version = 0
        self.connected = False
        self.last_ok_at: float | None = None
        self.last_error: str | None = None
        self.updates = 0
        self._task: asyncio.Task | None = None
        self._first = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def wait_first(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._first.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def snapshot_age_s(self) -> float | None:
        return None if self.last_ok_at is None else time.monotonic() - self.last_ok_at

    def apply(self, delta: dict[str, Any], received_at: float | None = None) -> list[str]:
        """Merge one answer of `Aggregator.snapshot`. Returns the names that changed."""
        now = time.monotonic() if received_at is None else received_at
        wall = time.time()
        if delta["full"] or delta["epoch"] != self.epoch:
            fresh: dict[str, WorkerRecord] = {}
        else:
            fresh = self.workers
        changed: list[str] = []
        for w in delta["workers"]:
            age = w["metrics_age_s"]
            fresh[w["name"]] = WorkerRecord(
                name=w["name"],
                url=w["url"],
                page_size=int(w["page_size"]),
                state=w["state"],
                healthy=bool(w["healthy"]),
                health_detail=w.get("health_detail", ""),
                metrics=w["metrics"],
                ranks=w["ranks"],
                metrics_at=None if age is None else now - age,
                heartbeat_at=now - w["heartbeat_age_s"],
                updated_at=wall,
                in_flight_by_replica=dict(w.get("in_flight_by_replica") or {}),
                extra=dict(w.get("extra") or {}),
            )
            changed.append(w["name"])
        names = set(delta["names"])
        for gone in [n for n in fresh if n not in names]:
            del fresh[gone]
            changed.append(gone)
        self.workers = fresh
        self.epoch = delta["epoch"]
        self.version = delta["version"]
        return changed

    async def _run(self) -> None:
        backoff = self.backoff_s
        agg = None
        while True:
            try:
                if agg is None:
                    agg = await self._resolve()
                delta = await agg.snapshot.remote(self.version, self.epoch, self.poll_timeout_s)
                changed = self.apply(delta)
                self.updates += 1
                self.connected = True
                self.last_ok_at = time.monotonic()
                self.last_error = None
                backoff = self.backoff_s
                self._first.set()
                if changed and self.on_update is not None:
                    self.on_update(changed)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable/restarting aggregator: keep routing on last view
                if self.connected or self.last_error is None:
                    logger.warning("aggregator unreachable (%s: %s); routing on last snapshot", type(exc).__name__, exc)
                self.connected = False
                self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                agg = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
