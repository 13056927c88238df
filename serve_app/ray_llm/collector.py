"""The in-replica KvMetrics collector of a Serve LLM replica: binds the PULL its engine's scheduler
connects to, keeps the latest value per DP rank and pushes worker reports to the aggregator.

Why in the replica and not a worker actor: the engine is in-process (`sglang.Engine`, schedulers
as Ray actors in the replica's placement group, so on its node), it has no HTTP `/health` a worker
actor could probe, and its lifetime is the replica's. The collector lives and dies with the
replica: liveness is its heartbeat (a crashed replica is `down` after `Settings.down_after_s`),
`stop()` deregisters it on a graceful stop. Decoding, ingest, the report and the link are the
worker actor's own pieces (`MetricsBook`, `WorkerReport`, `AggregatorLink`, `bind_pull`).
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

from actors.aggregator import get_or_create_aggregator
from actors.ingest import MetricsBook
from actors.link import AggregatorLink
from actors.models import Settings
from actors.protocol import RankMetrics, WorkerReport
from actors.worker_actor import bind_pull

logger = logging.getLogger("kvroute.ray_llm.collector")

_DRAIN_BATCH = 4096


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
        self._wake = asyncio.Event()
        self._stopped = False
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv_loop()), loop.create_task(self._push_loop())]
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

    async def _recv_loop(self) -> None:
        sock = self._sock
        raw = zmq.Socket.shadow(sock.underlying)
        while True:
            try:
                await sock.poll(flags=zmq.POLLIN)
                for _ in range(_DRAIN_BATCH):
                    try:
                        frame = raw.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if raw.getsockopt(zmq.RCVMORE):  # SGLang never sends multipart
                        while raw.getsockopt(zmq.RCVMORE):
                            raw.recv(zmq.NOBLOCK)
                        self.book.stats.frames_received += 1
                        self.book.refuse("multipart", "multipart message")
                        continue
                    if self.book.ingest(frame) is not None:
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # a receive loop must never die
                logger.exception("worker %s: receive loop error", self.name)
                await asyncio.sleep(0.01)

    async def _push_loop(self) -> None:
        """The newest state at most every `push_interval_s` when it changed, else every `heartbeat_s`."""
        s = self.settings
        last = 0.0
        while True:
            try:
                wait = s.heartbeat_s - (time.monotonic() - last)
                if wait > 0 and not self._wake.is_set():
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=wait)
                    except asyncio.TimeoutError:
                        pass
                gap = s.push_interval_s - (time.monotonic() - last)
                if gap > 0:
                    await asyncio.sleep(gap)
                if not await self._link.ensure():
                    await asyncio.sleep(min(s.reconnect_backoff_s, s.heartbeat_s))
                    continue
                self._wake.clear()
                if not self._link.push_reports([self.report()]):
                    self._wake.set()
                last = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker %s: push loop error", self.name)
                await asyncio.sleep(s.push_interval_s)

    async def stop(self) -> None:
        """Stop the loops, leave the aggregator's fleet (best effort), close the socket."""
        if self._stopped:
            return
        self._stopped = True
        for t in self._tasks:
            t.cancel()
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
