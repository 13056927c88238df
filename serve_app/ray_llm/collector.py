"""The in-replica KvMetrics collector of a Serve LLM replica: binds the PULL its engine's scheduler
connects to, keeps the latest value per DP rank and pushes worker reports to the aggregator.

Why in the replica and not a worker actor: the engine is in-process (`sglang.Engine`, schedulers
as Ray actors in the replica's placement group, so on its node), it has no HTTP `/health` a worker
actor could probe, and its lifetime is the replica's. The collector lives and dies with the
replica: liveness is its heartbeat (a crashed replica is `down` after `Settings.down_after_s`),
`stop()` deregisters it on a graceful stop. Receive, ingest, coalescing and the push with its
heartbeat are the worker actor's own pipeline (`actors.worker.metrics_pipe.MetricsPipe` over `bind_pull`'s
PULL, a `MetricsBook` and an `AggregatorLink`); what is the collector's own is the replica's
registration: its worker name, its `serve://` url and the engine's health in each report — and, in
exact prefix mode, the name of the replica's KV-log actor (`kv_log_actor`) with that subscription's
status, which it refreshes once per heartbeat from the actor (`watch`, carrying the KvMetrics
evidence the actor's silence watch needs).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from typing import Any, Callable

import zmq
import zmq.asyncio

from actors.aggregator.actor import get_or_create_aggregator
from actors.worker.endpoint import bind_pull
from actors.worker.ingest import MetricsBook
from actors.wire.kv_handshake import shows_prefill
from actors.transport.link import AggregatorLink
from actors.worker.metrics_pipe import MetricsPipe
from actors.models import Settings
from actors.protocol import KvEventsStatus, RankMetrics, WorkerReport

logger = logging.getLogger("kvroute.ray_llm.collector")


def default_metrics_endpoint(unique_id: str) -> str:
    """A node-local ipc:// path for one replica (SGLang's own is random and never printed)."""
    return f"ipc://{tempfile.gettempdir()}/kvroute-serve-{unique_id}-{os.getpid()}.metrics"


class ReplicaCollector:
    """KvMetrics of one replica's engine → the aggregator, as worker `name`.

    `health()` says whether the engine can serve (True, "ok") — called at every heartbeat.
    Construct inside the replica's event loop; `stop()` is idempotent and takes ≤ 1 s."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        *,
        settings: Settings | None = None,
        page_size: int = 1,
        url: str = "",
        health: Callable[[], tuple[bool, str]] = lambda: (True, "ok"),
    ) -> None:
        """Binds `endpoint` at once (SGLang's scheduler connects as it starts); `follow_kv_log` names
        the replica's KV-log actor later, once it is up."""
        self.name = name
        self.endpoint = endpoint
        self.settings = settings or Settings()
        self.page_size = page_size
        self.url = url
        self.incarnation = uuid.uuid4().hex[:12]
        self._health = health
        self.book = MetricsBook(self.settings.max_frame_bytes)
        self._ctx = zmq.asyncio.Context()
        self._sock = bind_pull(self._ctx, name, endpoint, self.settings.max_frame_bytes)
        s = self.settings
        self._link = AggregatorLink(self._resolve, ctx=self._ctx, hwm=s.max_pending_pushes,
                                    backoff_s=s.reconnect_backoff_s, backoff_max_s=s.reconnect_backoff_max_s)
        self._stopped = False
        self._wake = asyncio.Event()
        self._pipe = MetricsPipe(name, self._sock, self.book, self._link, s, self.report, wake=self._wake)
        self._tasks = self._pipe.start()
        self.kv_events_actor: str | None = None
        self.kv_events: KvEventsStatus | None = None
        self.kv_watch_errors = 0
        logger.info("worker %s: PULL bound on %s (in-replica collector)", name, endpoint)

    def follow_kv_log(self, actor_name: str, handle: Any) -> None:
        """Exact prefix mode: report `actor_name` as this worker's `kv_events_actor` (routers follow its
        `kv_since`) and poll its subscription status once per heartbeat."""
        self.kv_events_actor = actor_name
        self.kv_events = KvEventsStatus(status="waiting", handshake=[], batches=0)
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_kv(handle, time.monotonic())))
        self._wake.set()

    async def _watch_kv(self, handle: Any, opened_at: float) -> None:
        while True:
            busy = any(shows_prefill(m.kv_active_blocks, self.page_size, at, opened_at)
                       for m, at in self.book.latest_with_times().values())
            try:
                status = await asyncio.wait_for(handle.watch.remote(busy), timeout=5.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor died with (or before) the replica: routers notice too
                self.kv_watch_errors += 1
                logger.debug("worker %s: KV-log actor status failed: %s", self.name, exc)
            else:
                if self.kv_events is None or status.status != self.kv_events.status:
                    self._wake.set()
                self.kv_events = status
            await asyncio.sleep(self.settings.health_interval_s)

    async def _resolve(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "endpoint": self.endpoint, **self.book.stats.as_dict(),
                "kv_events_actor": self.kv_events_actor,
                "kv_events": None if self.kv_events is None else self.kv_events.status,
                "pushes": self._link.sent, "pushes_dropped": self._link.dropped,
                "latest": {r: m.model_dump() for r, m in self.book.latest().items()}}

    def report(self) -> WorkerReport:
        healthy, detail = self._health()
        ranks = [RankMetrics(**d) for d in self.book.ranks_report(self.page_size).values()]
        return WorkerReport(name=self.name, url=self.url, page_size=self.page_size, incarnation=self.incarnation,
                            healthy=healthy, health_detail=detail, ranks=ranks,
                            kv_events_actor=self.kv_events_actor, kv_events=self.kv_events)

    async def stop(self) -> None:
        """Stop the loops, leave the aggregator's fleet (best effort), close the socket."""
        if self._stopped:
            return
        self._stopped = True
        self._pipe.stop()  # no push after this; cancels the pipe's tasks
        await asyncio.wait(set(self._tasks), timeout=0.5)
        if self._link.handle is not None:
            try:
                await asyncio.wait_for(self._link.handle.remove.remote(self.name), timeout=0.5)
            except Exception:  # the aggregator may be gone: the heartbeat timeout removes us then
                pass
        self._link.close()
        self._sock.close(linger=0)
        path = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
        self._ctx.term()
        logger.info("worker %s: collector stopped", self.name)
