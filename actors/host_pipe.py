"""A metrics host's pipeline, written once: the SGLang KvMetrics frames of every worker it hosts,
each from its own bound PULL into its own `MetricsBook`, and one `HostFrame` per coalescing window
for all of them — which is also their heartbeat (one per host per `heartbeat_s` when nothing changed).

Used by the node's metrics host actor (`actors.metrics_host.MetricsHost`); `bench.scale`'s emulated
hosts send the same frames through the same `AggregatorLink.push_host`. No Ray import.

Receive: the event loop calls a drain when a PULL is readable (`actors.readable.SocketWatch`).
Push: `actors.push_window.PushWindow`, for the host as a whole: the first change after a quiet spell
goes at once from the receive callback; then every receive watch sleeps and one timer per window
drains every socket and pushes one frame with each changed worker's whole report. After the link
(re)connects — a restarted aggregator holds nothing — the next frame carries every worker's report.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable

import zmq

from actors.ingest import MetricsBook
from actors.link import AggregatorLink
from actors.metrics_pipe import receive
from actors.models import Settings
from actors.protocol import WorkerReport
from actors.push_window import PushWindow
from actors.readable import SocketWatch

logger = logging.getLogger("kvroute.host")


class _Slot:
    """One hosted worker's receive side."""

    __slots__ = ("name", "raw", "book", "report", "watch", "dirty")

    def __init__(self, name: str, sock: zmq.Socket | None, book: MetricsBook | None,
                 report: Callable[[], WorkerReport]) -> None:
        self.name = name
        self.raw = None if sock is None else zmq.Socket.shadow(sock.underlying)  # sync view: cheap drains
        self.book = book
        self.report = report
        self.watch: SocketWatch | None = None
        self.dirty = True  # its report changed since the last frame that was queued (new: register it)


class HostPipe(PushWindow):
    """Hosted workers' PULLs → their books → one coalesced `HostFrame` per window over `link`.

    `add()` a worker (its bound PULL, its book, its `report()`), `mark()` it when its liveness or
    status changed (pushed at once), `remove()` it. `start()` runs the pipe inside the event loop,
    `stop()` ends it (idempotent: no frame goes after it). The caller owns and closes the sockets."""

    def __init__(self, host: str, link: AggregatorLink, settings: Settings, heartbeat_s: float | None = None) -> None:
        super().__init__(f"host {host}", link, settings, heartbeat_s=heartbeat_s)
        self.host = host
        self.incarnation = uuid.uuid4().hex[:12]
        self._slots: dict[str, _Slot] = {}
        self._names: list[str] = []
        self._full_for = -1  # link.connections when the last frame with every report was queued
        self._started = False
        self._task: asyncio.Task | None = None
        self.frames = 0  # frames queued toward the aggregator
        self.full_frames = 0  # of them, frames with every worker's report (start, aggregator reconnects)

    def names(self) -> list[str]:
        return list(self._names)

    def add(self, name: str, sock: zmq.Socket | None, book: MetricsBook | None,
            report: Callable[[], WorkerReport]) -> None:
        """Host `name`: its bound PULL and book (None, None: its metrics arrive through `changed()`
        instead — an emulated worker) and the `report()` of its current state."""
        if name in self._slots:
            raise ValueError(f"worker {name}: already hosted by {self.host}")
        slot = self._slots[name] = _Slot(name, sock, book, report)
        self._names = list(self._slots)
        if self._started:
            self._watch(slot)
        self.wake.set()

    def remove(self, name: str) -> bool:
        """Stop receiving for `name`; the next frame no longer vouches for it (sent at once)."""
        slot = self._slots.pop(name, None)
        if slot is None:
            return False
        if slot.watch is not None:
            slot.watch.close()
        self._names = list(self._slots)
        self.wake.set()
        return True

    def changed(self, name: str) -> None:
        """New metrics for `name` arrived other than through its PULL (an emulated worker): pushed as
        frames received on the PULL are (throttled on both edges)."""
        slot = self._slots.get(name)
        if slot is not None:
            slot.dirty = True
            self._metrics_arrived()

    def mark(self, name: str) -> None:
        """`name`'s liveness or status changed: its report goes in a frame now."""
        slot = self._slots.get(name)
        if slot is not None:
            slot.dirty = True
            self.wake.set()

    def start(self) -> asyncio.Task:
        self._started = True
        for slot in self._slots.values():
            self._watch(slot)
        self._task = asyncio.get_running_loop().create_task(self._push_loop())
        return self._task

    def stop(self) -> None:
        if not self._stop_windows():
            return
        for slot in self._slots.values():
            if slot.watch is not None:
                slot.watch.close()
        if self._task is not None:
            self._task.cancel()

    # --- receive ------------------------------------------------------------------------------

    def _watch(self, slot: _Slot) -> None:
        if slot.raw is None:
            return
        slot.watch = SocketWatch(slot.raw, lambda: self._drain(slot), exhaustive=True)
        if self._timer is not None:  # inside a window: frames wait for its end
            slot.watch.pause()

    def _drain(self, slot: _Slot, notify: bool = True) -> bool:
        """Ingest what waits on `slot`'s PULL (a bounded batch); True if more may wait."""
        raw, book = slot.raw, slot.book
        if raw is None or book is None:
            return False
        more, fresh = receive(raw, book, f"host {self.host}: worker {slot.name}")
        if fresh:
            slot.dirty = True
            if notify:
                self._metrics_arrived()
        return more

    # --- PushWindow ---------------------------------------------------------------------------

    def _pause_receive(self) -> None:
        for slot in self._slots.values():
            if slot.watch is not None:
                slot.watch.pause()

    def _resume_receive(self) -> None:
        for slot in list(self._slots.values()):
            if slot.watch is not None:
                slot.watch.resume_now()

    def _drain_waiting(self) -> None:
        for slot in list(self._slots.values()):
            self._drain(slot, notify=False)

    def _unpushed(self) -> bool:
        return any(s.dirty for s in self._slots.values())

    def _push_now(self) -> bool:
        """One frame: the changed workers' reports (every worker's after a (re)connect), vouching for all."""
        if self._stopping:
            return True
        if not self.link.ready():
            self.wake.set()
            return False
        full = self.link.connections != self._full_for
        connections = self.link.connections
        slots = [s for s in self._slots.values() if full or s.dirty]
        ok = self.link.push_host(self.host, self.incarnation, self._names, [s.report() for s in slots])
        self._last_push = time.monotonic()
        if ok:
            self.frames += 1
            for s in slots:
                s.dirty = False
            if full:
                self._full_for = connections
                self.full_frames += 1
        return ok
