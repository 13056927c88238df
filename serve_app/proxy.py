"""Upstream HTTP to SGLang workers: pooled keep-alive HTTP/1.1 connections, streaming pass-through.

A small client on asyncio's protocol layer with httptools' C parser (the parser uvicorn uses)
rather than a general-purpose one (aiohttp, httpx): a streamed reply costs one parser feed and one
Python callback per arriving segment — the body bytes are kept as they come, never re-parsed or
copied into a stream reader — and opening a request is one write of a prebuilt head. Measured
in the router replica (`bench/results/request-path-2.md`) the general client's per-request and
per-segment work was a fifth of the replica's request-path samples. The relay batches what
arrived meanwhile into one piece (`Upstream.chunks`).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from functools import lru_cache
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import httptools

# Hop-by-hop and framing headers we must not copy between the two connections.
_SKIP_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-authenticate", "authorization", "accept-encoding",
    "content-encoding", "date", "server",
}
# A response body is relayed as the worker encoded it (nothing decompresses it), so its
# content-encoding goes with it; none is asked for (accept-encoding is not forwarded).
_SKIP_RESPONSE_HEADERS = {h.encode() for h in _SKIP_HEADERS - {"content-encoding"}}
RETRYABLE_STATUS = {429, 500, 502, 503, 504}  # before the first byte nothing was sent: try elsewhere
# Events relayed unbatched at a stream's start: SGLang's role-only chat chunk, then the first token's.
_UNBATCHED_EVENTS = 2
# An idle pooled connection older than this is closed, not reused: SGLang's server (uvicorn) closes
# idle keep-alive connections after 5 s (SGLANG_TIMEOUT_KEEP_ALIVE), and a request written on one at
# that moment is lost with it (a failed attempt that counts against the worker's breaker).
_KEEPALIVE_S = 4.0
# Arrived, not yet relayed body bytes beyond which the worker's socket is not read until the
# relay takes them (a slow client then slows the worker's connection, not the router's memory).
_HIGH_WATER = 1 << 20


class UpstreamBroken(ConnectionError):
    """The worker's connection broke, or its answer was malformed, after the request was sent."""


# What a broken upstream raises: connection reset, truncated or malformed body, per-read timeout.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (UpstreamBroken, asyncio.TimeoutError)


class UpstreamError(Exception):
    """The worker failed before sending a first byte (connect error, reset, retryable status)."""

    def __init__(self, worker: str, detail: str, status: int | None = None, retry_after: str | None = None,
                 *, timeout: bool = False):
        super().__init__(f"worker {worker}: {detail}")
        self.worker = worker
        self.status = status
        self.retry_after = retry_after
        self.timeout = timeout  # no answer in time: overload (the worker's, or this router's loop lag)

    @property
    def counts_for_breaker(self) -> bool:
        """Whether this failure is evidence the worker is broken: refused or reset connections and
        5xx answers are; a timeout is not. Under load a connect or header timeout means an overloaded
        engine, or a router replica whose own event loop ran late (timers fire after the deadline
        although the peer answered) — ejecting the worker then moves its load onto the others and
        overloads them in turn. Dead workers are marked `down` by their liveness probes instead."""
        return not self.timeout and (self.status is None or self.status >= 500)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Ticks:
    """One clock for the batch windows of every stream a replica relays: it ticks every
    `interval_s` on a fixed grid of the loop's time, and a window ends at the next tick.

    A window timed from its own stream's last piece would wake the event loop once per piece of
    every stream — a few hundred wake-ups a second at 20 concurrent streams, each costing the
    kernel's sleep and wake-up and a loop iteration (on a small VM ~0.1 ms of CPU, more than the
    piece's own work). On a shared grid all streams' pieces leave in the same loop pass, one
    timer per tick; a piece still waits at most `interval_s` (less when its window starts
    between ticks)."""

    __slots__ = ("loop", "interval_s", "_waiters", "_handle", "_last")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self._waiters: list[asyncio.Future[bool]] = []
        self._handle: asyncio.TimerHandle | None = None
        self._last = float("-inf")  # the last tick scheduled

    def next(self, waiter: asyncio.Future[bool] | None = None) -> asyncio.Future[bool]:
        """A future that the next tick resolves with False (`waiter`, if given, else a new one)."""
        w = self.loop.create_future() if waiter is None else waiter
        self._waiters.append(w)
        if self._handle is None:
            i = self.interval_s
            # (a timer may fire up to a millisecond early, its loop's clock granularity: never the same tick twice)
            at = self._last = max((self.loop.time() // i + 1) * i, self._last + i)
            self._handle = self.loop.call_at(at, self._tick)
        return w

    def _tick(self) -> None:
        self._handle = None
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(False)


_TICKS: dict[tuple[asyncio.AbstractEventLoop, float], _Ticks] = {}


def _ticks(interval_s: float) -> _Ticks:
    """The running loop's clock for windows of `interval_s`."""
    loop = asyncio.get_running_loop()
    t = _TICKS.get((loop, interval_s))
    if t is None:
        for key in [k for k in _TICKS if k[0].is_closed()]:  # (loops of finished tests, runs)
            del _TICKS[key]
        t = _TICKS[(loop, interval_s)] = _Ticks(loop, interval_s)
    return t


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a worker and the response being read on it (httptools callbacks)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]) -> None:
        self.loop = loop
        self.key = key  # (host, port, tls): its pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[bool] | None = None
        self._wake_on_body = False
        self.reset()

    def reset(self) -> None:
        """Ready for the next request on this connection."""
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False  # the whole response is in
        self.body: list[bytes] = []  # arrived, not yet taken
        self.buffered = 0  # bytes in `body`
        self.paused = False  # not read: `body` is above the high-water mark until the relay takes it
        self.held = False  # not read: a batch window is on (`hold`), the worker's bytes wait in the kernel
        self.error: UpstreamBroken | None = None
        self.keep_alive = False
        self.until_close = False  # a body without length or chunking: it ends when the connection does

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"malformed response: {exc}"))
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_close and exc is None and not self.done:
            self.done = True
            self._wake()
        if not self.done:
            what = f"{type(exc).__name__}: {exc}" if exc is not None else "the worker closed the connection"
            self._fail(UpstreamBroken(f"{what} before the response ended"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        names = {k.lower() for k, _ in self.raw_headers}
        self.until_close = (b"content-length" not in names and b"transfer-encoding" not in names
                            and self.status not in (204, 304) and not 100 <= self.status < 200)
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            if not self.held:
                self.transport.pause_reading()  # type: ignore[union-attr]
        if self._wake_on_body:
            self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self._wake()

    def _fail(self, exc: UpstreamBroken) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    async def wait(self, timeout_s: float, *, on_body: bool) -> bool:
        """Until the head completes, the response ends, the connection breaks or (with `on_body`)
        body bytes arrive — True — or `timeout_s` passes: False."""
        w = self._waiter = self.loop.create_future()
        self._wake_on_body = on_body
        timer = self.loop.call_later(timeout_s, _expire, w)
        try:
            return await w
        finally:
            timer.cancel()
            self._waiter = None
            self._wake_on_body = False

    async def wait_tick(self, ticks: _Ticks) -> bool:
        """Until the response ends or the connection breaks — True — or the next tick: False."""
        w = self._waiter = ticks.next(self.loop.create_future())
        try:
            return await w
        finally:
            self._waiter = None

    def take(self) -> bytes:
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.buffered = 0
        if self.paused:
            self.paused = False
            if not self.held and not self.closed:
                self.transport.resume_reading()  # type: ignore[union-attr]
        return data

    def hold(self) -> None:
        """Stop reading the worker's socket until `unhold`: what it writes meanwhile waits in the
        kernel's buffer and arrives in one read then, instead of one loop wake-up, read and parser
        pass per token. Nothing on the connection is seen meanwhile — its end, a reset — so hold
        only for a bounded time. (Independent of the high-water pause: reading resumes when neither
        holds it.)"""
        if not self.held and not self.closed:
            self.held = True
            if not self.paused:
                self.transport.pause_reading()  # type: ignore[union-attr]

    def unhold(self) -> None:
        if self.held:
            self.held = False
            if not self.paused and not self.closed:
                self.transport.resume_reading()  # type: ignore[union-attr]


class Upstream:
    """An open upstream response whose status and headers are known and whose body is unread."""

    __slots__ = ("_client", "_conn", "_read_timeout_s", "_released", "status_code", "worker")

    def __init__(self, worker: str, conn: _Connection, client: UpstreamClient, read_timeout_s: float) -> None:
        self.worker = worker
        self.status_code = conn.status
        self._conn = conn
        self._client = client
        self._read_timeout_s = read_timeout_s
        self._released = False

    @property
    def content_type(self) -> str | None:
        for k, v in self._conn.raw_headers:
            if k.lower() == b"content-type":
                return v.decode("latin-1")
        return None

    @property
    def at_eof(self) -> bool:
        """The whole body has arrived and been taken: the piece just yielded was the last."""
        return self._conn.done and not self._conn.body

    def headers(self) -> dict[str, str]:
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self._conn.raw_headers
                if k.lower() not in _SKIP_RESPONSE_HEADERS}

    async def _more(self) -> None:
        """Wait for body bytes, the end or a break; a silent worker is a TimeoutError."""
        conn = self._conn
        if conn.error is not None:
            raise conn.error
        if not await conn.wait(self._read_timeout_s, on_body=True):
            raise asyncio.TimeoutError(f"worker {self.worker}: nothing for {self._read_timeout_s} s")

    async def read(self) -> bytes:
        """The whole body (raises one of UPSTREAM_ERRORS if the worker breaks off)."""
        conn = self._conn
        parts: list[bytes] = []
        while True:
            if conn.body:
                parts.append(conn.take())  # (taking also resumes a connection paused at the high-water mark)
            if conn.done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._more()

    async def chunks(self, batch_interval_s: float = 0.0, *, hold_reads: bool = False) -> AsyncIterator[bytes]:
        """The body as it arrives, bytes unchanged (SSE events stay whole and in order).

        With `batch_interval_s` > 0, the first two SSE events go out the moment they arrive —
        SGLang's chat stream opens with a role-only event written just before the first token's,
        so neither the first byte nor the first token is held — and after that, what arrives waits
        until the next tick of a clock the replica's streams share (`_Ticks`: every
        `batch_interval_s`, so at most that long after the previous piece went out) and leaves
        together with everything else that came meanwhile. A 12-token reply then leaves the
        replica (and crosses Serve's ingress) as a few pieces instead of one per token, each of
        which costs CPU, and concurrent streams' pieces leave in one event-loop wake-up.

        Without `hold_reads` the connection is read meanwhile and the end of the body leaves the
        moment it arrives (`at_eof` tells the caller that a piece was the last). With it, from the
        second batch window on the connection is not read while a piece waits
        (`_Connection.hold`): the tokens of one piece are read in one go instead of one wake-up
        each, but the end of the body (or a break) is then seen only when the window ends — the
        last piece waits like the others, at most `batch_interval_s`. The first window is read as
        it comes, so a short reply (one that ends within it) is never held.
        """
        conn = self._conn
        events_out = 0
        windows = 0
        ticks = _ticks(batch_interval_s) if batch_interval_s > 0 else None
        while True:
            if conn.body:
                data = conn.take()
                yield data
                if batch_interval_s <= 0 or conn.done:
                    continue
                if events_out < _UNBATCHED_EVENTS:
                    events_out += data.count(b"\n\n")
                    if events_out < _UNBATCHED_EVENTS:
                        continue
                if conn.error is not None:
                    continue
                windows += 1
                if hold_reads and windows > 1:
                    conn.hold()
                    try:
                        await ticks.next()  # type: ignore[union-attr]
                    finally:
                        conn.unhold()  # what waited is read at the next loop pass; `_more` waits for it
                else:
                    await conn.wait_tick(ticks)  # type: ignore[arg-type]  # the end or a break cuts it short
            elif conn.done:
                return
            else:
                await self._more()

    async def close(self) -> None:
        """Back to the pool if the body was read to its end; otherwise the connection is closed
        (that is also what tells SGLang to abort a request whose client went away)."""
        if self._released:
            return
        self._released = True
        self._client._release(self._conn)


@lru_cache(maxsize=4096)
def _target(url: str) -> tuple[tuple[str, int, bool], bytes]:
    """(host, port, tls) and the request target of an http(s) URL."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = u.scheme == "https"
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return (u.hostname, u.port or (443 if tls else 80), tls), target.encode("latin-1")


def forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _SKIP_HEADERS and not k.lower().startswith("x-kvroute-")}


class UpstreamClient:
    """Opens requests to workers; raises UpstreamError for failures a retry elsewhere may fix."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s  # TCP (+ TLS) connect
        self._read_timeout_s = read_timeout_s  # each wait for the worker: the head, then every body read
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self, worker: str, key: tuple[str, int, bool]) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        now = loop.time()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have been closed by the worker
            fresh = now - conn.idle_since < _KEEPALIVE_S
            if fresh and not conn.closed and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
            conn.transport.close()  # type: ignore[union-attr]
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop, key), host, port, ssl=self._ssl if tls else None),
                self._connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamError(worker, f"timed out connecting ({self._connect_timeout_s} s)", timeout=True) from None
        except OSError as exc:
            raise UpstreamError(worker, f"{type(exc).__name__}: {str(exc)[:120]}") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        if conn.done and conn.keep_alive and not conn.closed and conn.error is None:
            if conn.paused or conn.held:
                conn.transport.resume_reading()  # type: ignore[union-attr]
            conn.reset()
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.key, []).append(conn)
            return
        self._abort(conn)

    async def open(self, worker: str, method: str, url: str, *, content: bytes | None = None,
                   headers: dict[str, str] | None = None) -> Upstream:
        try:
            key, target = _target(url)
        except ValueError as exc:
            raise UpstreamError(worker, str(exc)) from None
        conn = await self._connect(worker, key)
        host, port, _ = key
        head = [method.encode("latin-1"), b" ", target, b" HTTP/1.1\r\nhost: ", f"{host}:{port}".encode("latin-1")]
        for k, v in (headers or {}).items():
            head += [b"\r\n", k.encode("latin-1"), b": ", v.encode("latin-1")]
        if content is not None:
            head += [b"\r\ncontent-length: ", str(len(content)).encode()]
        head.append(b"\r\n\r\n")
        if content:
            head.append(content)
        try:
            conn.transport.write(b"".join(head))  # type: ignore[union-attr]
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                if not await conn.wait(self._read_timeout_s, on_body=False):
                    raise asyncio.TimeoutError
        except asyncio.TimeoutError:
            self._abort(conn)
            raise UpstreamError(worker, f"timed out before the response ({self._read_timeout_s} s)",
                                timeout=True) from None
        except (UpstreamBroken, OSError) as exc:
            self._abort(conn)
            raise UpstreamError(worker, f"{type(exc).__name__}: {str(exc)[:120]}") from None
        except BaseException:  # cancelled (the client went away): the worker must see the request end
            self._abort(conn)
            raise
        up = Upstream(worker, conn, self, self._read_timeout_s)
        if conn.status in RETRYABLE_STATUS:
            retry_after = next((v.decode("latin-1") for k, v in conn.raw_headers if k.lower() == b"retry-after"), None)
            if not conn.body and not conn.done and conn.error is None:
                await conn.wait(self._read_timeout_s, on_body=True)
            body = b"".join(conn.body)[:200].decode("utf-8", "replace")
            self._abort(conn)
            raise UpstreamError(worker, f"status {conn.status}: {body}", conn.status, retry_after)
        return up

    def _abort(self, conn: _Connection) -> None:
        conn.closed = True
        if conn.transport is not None:
            conn.transport.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                self._abort(conn)
            idle.clear()


def sse_error_event(message: str, code: str = "upstream_failed") -> bytes:
    """How a stream that broke after it started ends: one OpenAI-style error event, then [DONE]."""
    payload = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
