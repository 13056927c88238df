"""One worker's metrics pipeline, written once: SGLang's KvMetrics frames from a bound PULL into a
`MetricsBook`, and coalesced `WorkerReport`s over an `AggregatorLink`, with a heartbeat.

Used by the worker actor (`actors.worker_actor.WorkerActor`) and by a Ray Serve LLM replica's
in-replica collector (`serve_app.ray_llm.collector.ReplicaCollector`); each keeps only what differs
(liveness probes and the managed engine; replica registration) and hands the pipe a `report()`.

Receive: the event loop calls a drain when the PULL is readable (`actors.readable.SocketWatch`: one
callback per arrival, no future per frame); multipart messages are refused (SGLang never sends them).
Push: throttled on both edges (`Settings.coalesce_s`, see `MetricsPipe._metrics_arrived`), plus a
push loop for heartbeats, woken changes (liveness, status) and reconnection. No Ray import.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq

from actors.ingest import MetricsBook
from actors.link import AggregatorLink
from actors.models import Settings
from actors.protocol import WorkerReport
from actors.readable import SocketWatch

logger = logging.getLogger("kvroute.worker")

DRAIN_BATCH = 4096  # frames handled per wake-up before yielding to other tasks


def drain_frames(raw: zmq.Socket, book: MetricsBook) -> tuple[bool, bool]:
    """Ingest what waits on an SGLang metrics PULL into `book`, a bounded batch (multipart messages
    are refused: SGLang never sends one). Returns (more may wait, new metrics arrived)."""
    fresh = False
    for _ in range(DRAIN_BATCH):
        try:
            frame = raw.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False, fresh
        if raw.getsockopt(zmq.RCVMORE):
            while raw.getsockopt(zmq.RCVMORE):
                raw.recv(zmq.NOBLOCK)
            book.stats.frames_received += 1
            book.refuse("multipart", "multipart message")
            continue
        if book.ingest(frame) is not None:
            fresh = True
    return True, fresh


class MetricsPipe:
    """PULL socket → `book` → coalesced `report()`s over `link`, for worker `name`.

    `sock` is a bound PULL (the caller binds it and closes it after `stop()`); `wake` (optional, the
    caller's own event) asks the push loop for a push now — e.g. a liveness change. `start()` runs it
    (inside the event loop); `stop()` ends it (idempotent: no push goes after it)."""

    def __init__(
        self,
        name: str,
        sock: zmq.Socket,
        book: MetricsBook,
        link: AggregatorLink,
        settings: Settings,
        report: Callable[[], WorkerReport],
        *,
        wake: asyncio.Event | None = None,
    ) -> None:
        self.name = name
        self.book = book
        self.link = link
        self.settings = settings
        self._report = report
        self.wake = wake if wake is not None else asyncio.Event()
        self._raw = zmq.Socket.shadow(sock.underlying)  # sync view of the socket: cheap drains
        self._watch: SocketWatch | None = None
        self._last_push = 0.0
        self._unpushed = False  # metrics ingested since the last report that was queued
        self._push_timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self.tasks: list[asyncio.Task] = []

    def start(self) -> list[asyncio.Task]:
        """Start receiving and pushing; returns the two tasks (also in `tasks`)."""
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._recv_loop()), loop.create_task(self._push_loop())]
        return self.tasks

    def stop(self) -> None:
        """No push after this: cancel the coalescing window and the tasks (the caller may await them)."""
        if self._stopping:
            return
        self._stopping = True
        if self._push_timer is not None:
            self._push_timer.cancel()
            self._push_timer = None
        for t in self.tasks:
            t.cancel()

    # --- receive ------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        """Receive SGLang's frames: the event loop calls `_drain` when the PULL is readable (one
        callback per arrival, no future per frame); this task only holds the watch until cancelled."""
        watch = self._watch = SocketWatch(self._raw, self._drain)
        try:
            await asyncio.Event().wait()
        finally:
            watch.close()

    def _drain(self, notify: bool = True) -> bool:
        """Ingest what is waiting (a bounded batch); True if more may wait. `notify`: new metrics
        go to `_metrics_arrived` (not when the coalescing window's end drains them)."""
        try:
            more, fresh = drain_frames(self._raw, self.book)
        except Exception:  # a receive path must never die (the newest state is pushed regardless)
            logger.exception("worker %s: receive error", self.name)
            more = fresh = True
        if fresh:
            self._unpushed = True
            if notify:
                self._metrics_arrived()
        return more

    # --- push ---------------------------------------------------------------------------------

    def _metrics_arrived(self) -> None:
        """New SGLang metrics, throttled on both edges: the first change after `coalesce_s` without a
        push goes at once, from the receive callback itself (no hand-off to the push loop). After
        that a coalescing window starts: the receive watch sleeps (SGLang's frames wait in the
        socket; the process is not woken per frame) and at its end one push carries the newest state."""
        if self._push_timer is not None:
            return
        if time.monotonic() - self._last_push >= self.settings.coalesce_s and self._push_now():
            return
        self._start_window()

    def _start_window(self) -> None:
        if self._watch is not None:
            self._watch.pause()
        wait = max(self.settings.coalesce_s - (time.monotonic() - self._last_push), self.settings.push_interval_s)
        self._push_timer = asyncio.get_running_loop().call_later(wait, self._window_ends)

    def _window_ends(self) -> None:
        """Drain what waited and push it; while the engine keeps sending, stay in windows (one
        wake-up and one push per `coalesce_s`); once a window stays empty, wake on arrival again."""
        self._push_timer = None
        if self._stopping:
            return
        self._drain(notify=False)
        if self._unpushed:
            self._push_now()  # if it is not queued, the next window (or the push loop) sends the newest
            self._start_window()
        elif self._watch is not None:
            self._watch.resume_now()

    def _push_now(self) -> bool:
        """Push the newest report if the link is up (else the push loop reconnects and sends it)."""
        if self._stopping:
            return True
        if not self.link.ready():
            self.wake.set()
            return False
        self._last_push = time.monotonic()
        ok = self.link.push_reports([self._report()])
        self._unpushed = self._unpushed and not ok
        return ok

    async def _push_loop(self) -> None:
        """Heartbeats, liveness and status changes, and reconnection: the newest state every
        `heartbeat_s` (counted from the last push, wherever it came from) or at once when woken;
        a push never waits on the aggregator (a frame it cannot queue is dropped and the next,
        newer report goes instead)."""
        s = self.settings
        while True:
            try:
                wait = s.heartbeat_s - (time.monotonic() - self._last_push)
                if wait > 0 and not self.wake.is_set():
                    try:
                        await asyncio.wait_for(self.wake.wait(), timeout=wait)
                    except asyncio.TimeoutError:
                        continue  # re-check: the receive path may have pushed meanwhile
                last = self._last_push
                gap = s.push_interval_s - (time.monotonic() - last)
                if gap > 0:
                    await asyncio.sleep(gap)
                if not await self.link.ensure():
                    await asyncio.sleep(min(s.reconnect_backoff_s, s.heartbeat_s))
                    continue
                self.wake.clear()
                if self.link.push_reports([self._report()]):
                    self._unpushed = False
                else:
                    self.wake.set()  # not queued: send the newest state again after the gap
                self._last_push = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker %s: push loop error", self.name)
                await asyncio.sleep(s.push_interval_s)
