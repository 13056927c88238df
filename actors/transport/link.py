"""The sending side of the metrics plane: a ZeroMQ PUSH to the aggregator's ingest, found through
Ray, re-found when the aggregator moves. Used by worker actors (reports), router replicas
(in-flight shares) and `bench.scale`'s emulated workers — one code path for every producer."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from actors.protocol import Endpoints, InFlightShare, ReportBatch, WorkerReport, encode
from actors.transport.retry import Backoff

logger = logging.getLogger("kvroute.link")


class AggregatorLink:
    """`push_reports` / `push_in_flight` never block: a frame the socket cannot queue (more than
    `hwm` unsent: the aggregator is away or slow) is dropped and the caller's next, newer state
    goes instead. `ensure()` connects: through Ray it asks the aggregator where it listens. When
    the connection has been down `stale_s`, `ensure()` answers False (push later) and asks Ray
    again in the background, keeping the socket: a restarted aggregator keeps its address and
    token, so ZeroMQ's own reconnect usually brings the link back first — without waiting for
    Ray to tell this process that the actor is alive again, which lags under load. Only an answer
    naming another address or token (the aggregator moved or is a new one) replaces the socket."""

    def __init__(
        self,
        resolve: Callable[[], Awaitable[Any]],
        *,
        ctx: zmq.asyncio.Context | None = None,
        hwm: int = 2,
        stale_s: float = 1.0,
        call_timeout_s: float = 10.0,
        backoff_s: float = 0.1,
        backoff_max_s: float = 0.5,
        client_ip: str | None = None,
    ) -> None:
        self._resolve = resolve
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.hwm, self.stale_s, self.call_timeout_s = hwm, stale_s, call_timeout_s
        self._backoff = Backoff(backoff_s, backoff_max_s)
        self._retry_at = 0.0
        self._client_ip = client_ip
        self.handle: Any = None  # the aggregator's Ray handle (lifecycle calls: remove, snapshot)
        self.endpoints: Endpoints | None = None
        self._sock: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._down_since: float | None = None
        self.sent = 0
        self.dropped = 0
        self.reconnects = 0
        self._lock: asyncio.Lock | None = None
        self.connections = 0  # TCP connections made to an aggregator: a new one may be a restarted aggregator
        self._reresolve_task: asyncio.Task | None = None

    @property
    def epoch(self) -> str | None:
        return None if self.endpoints is None else self.endpoints.epoch

    def ready(self) -> bool:
        """True when a push can go now without (re)connecting (no I/O: for callers that must not await)."""
        if self._sock is None:
            return False
        self._watch()
        return self._down_since is None or time.monotonic() - self._down_since < self.stale_s

    async def ensure(self) -> bool:
        """True when a socket is ready to push to; (re)resolves when needed, with back-off. Callers
        sharing one link share one resolution."""
        if self._sock is not None and self.ready():
            return True
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._ensure()

    async def _ensure(self) -> bool:
        if self._sock is not None:
            self._watch()
            if self._down_since is None or time.monotonic() - self._down_since < self.stale_s:
                return True
            if self._reresolve_task is None:
                logger.info("aggregator at %s unreachable for %.1f s; asking Ray where it is",
                            self.endpoints.ingest if self.endpoints else "?", time.monotonic() - self._down_since)
                self._reresolve_task = asyncio.get_running_loop().create_task(self._reresolve())
            return False
        now = time.monotonic()
        if now < self._retry_at:
            return False
        endpoints = await self._ask()
        if endpoints is None:
            self._retry_at = now + self._backoff.delay()  # never sleeps: a push loop must not block on us
            return False
        self._backoff.reset()
        self.endpoints = endpoints
        self._open_socket(endpoints.ingest)
        return True

    async def _ask(self) -> Endpoints | None:
        """The aggregator's endpoints through Ray, or None (logged) if it does not answer."""
        try:
            if self.handle is None:
                self.handle = await self._resolve()
            ip = self._client_ip or await asyncio.to_thread(_node_ip)
            return await asyncio.wait_for(self.handle.endpoints.remote(ip), self.call_timeout_s)
        except Exception as exc:
            self.handle = None
            logger.warning("aggregator unreachable (%s: %s); retrying", type(exc).__name__, str(exc)[:200])
            return None

    async def _reresolve(self) -> None:
        """The connection is down `stale_s`: ask Ray where the aggregator is (with back-off) until it
        answers or the socket reconnects by itself. Another address or token → a new socket; the
        same one still unreachable → the socket is opened afresh."""
        try:
            while self._sock is not None:
                endpoints = await self._ask()
                self._watch()
                if self._down_since is None:
                    if endpoints is not None:
                        self.endpoints = endpoints  # (the epoch: a restarted aggregator's new one)
                    return  # ZeroMQ reconnected first
                if endpoints is None:
                    await asyncio.sleep(self._backoff.delay())
                    continue
                self._backoff.reset()
                moved = self.endpoints is None or (endpoints.ingest, endpoints.token) != (
                    self.endpoints.ingest, self.endpoints.token)
                logger.info("aggregator at %s (%s); reconnecting", endpoints.ingest,
                            "moved" if moved else "same address")
                self.endpoints = endpoints
                self._close_socket()
                self._open_socket(endpoints.ingest)
                return
        finally:
            self._reresolve_task = None

    def push_reports(self, reports: list[WorkerReport]) -> bool:
        return self._push(ReportBatch(token=self._token(), reports=reports))

    def push_in_flight(self, replica: str, counts: dict[str, int]) -> bool:
        return self._push(InFlightShare(token=self._token(), replica=replica, counts=counts))

    def close(self) -> None:
        if self._reresolve_task is not None:
            self._reresolve_task.cancel()
            self._reresolve_task = None
        self._close_socket()

    # --- internals ----------------------------------------------------------------------------

    def _token(self) -> str:
        return self.endpoints.token if self.endpoints is not None else ""

    def _push(self, msg: Any) -> bool:
        if self._sock is None:
            self.dropped += 1
            return False
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def _open_socket(self, address: str) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self._sock = zmq.Socket.shadow(sock.underlying)  # sync view: sends are NOBLOCK
        self._owner = sock
        self._mon = zmq.Socket.shadow(mon.underlying)
        self._mon_owner = mon
        self._down_since = time.monotonic()  # until the first EVENT_CONNECTED
        self.reconnects += 1

    def _watch(self) -> None:
        """Fold the socket's connect/disconnect events into `_down_since` (no I/O when quiet)."""
        mon = self._mon
        if mon is None:
            return
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._down_since = None
                self.connections += 1
            elif event == zmq.EVENT_DISCONNECTED and self._down_since is None:
                self._down_since = time.monotonic()

    def _close_socket(self) -> None:
        if self._sock is not None:
            try:
                self._owner.disable_monitor()
            except zmq.ZMQError:
                pass
            self._mon_owner.close(linger=0)
            self._owner.close(linger=0)
        self._sock = self._mon = None


def _node_ip() -> str | None:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return None
