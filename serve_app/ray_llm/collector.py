"""The in-replica KvMetrics collector of a Serve LLM replica: binds the PULL its engine's scheduler
connects to, keeps the latest value per DP rank and pushes worker reports to the aggregator.

Why in the replica and not a worker actor: the engine is in-process (`sglang.Engine`, schedulers
as Ray actors in the replica's placement group, so on its node), it has no HTTP `/health` a worker
actor could probe, and its lifetime is the replica's. The collector lives and dies with the
replica: liveness is its heartbeat (a crashed replica is `down` after `Settings.down_after_s`),
`stop()` deregisters it on a graceful stop. Receive, ingest, coalescing and the push with its
heartbeat are the worker actor's own pipeline (`actors.metrics_pipe.MetricsPipe` over `bind_pull`'s
PULL, a `MetricsBook` and an `AggregatorLink`); what is the collector's own is the replica's
registration: its worker name, its `serve://` url and the engine's health in each report.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from typing import Any, Callable

import zmq
import zmq.asyncio

from actors.aggregator import get_or_create_aggregator
from actors.ingest import MetricsBook
from actors.link import AggregatorLink
from actors.metrics_pipe import MetricsPipe
from actors.models import Settings
from actors.protocol import RankMetrics, WorkerReport
from actors.worker_actor import bind_pull

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
        self._pipe = MetricsPipe(name, self._sock, self.book, self._link, s, self.report)
        self._tasks = self._pipe.start()
        logger.info("worker %s: PULL bound on %s (in-replica collector)", name, endpoint)

    async def _resolve(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "endpoint": self.endpoint, **self.book.stats.as_dict(),
                "pushes": self._link.sent, "pushes_dropped": self._link.dropped,
                "latest": {r: m.model_dump() for r, m in self.book.latest().items()}}

    def report(self) -> WorkerReport:
        healthy, detail = self._health()
        ranks = [RankMetrics(**d) for d in self.book.ranks_report(self.page_size).values()]
        return WorkerReport(name=self.name, url=self.url, page_size=self.page_size, incarnation=self.incarnation,
                            healthy=healthy, health_detail=detail, ranks=ranks)

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
