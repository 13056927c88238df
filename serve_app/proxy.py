"""Upstream HTTP to SGLang workers: one pooled aiohttp session per replica, streaming pass-through.

aiohttp rather than httpx: its C-accelerated HTTP parser makes relaying a stream cheaper for the
replica, and its stream reader hands over everything that has arrived in one read, which is what
lets a relay batch several SSE events into one piece (`Upstream.chunks`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp

# Hop-by-hop and framing headers we must not copy between the two connections.
_SKIP_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-authenticate", "authorization", "accept-encoding",
    "content-encoding", "date", "server",
}
RETRYABLE_STATUS = {429, 500, 502, 503, 504}  # before the first byte nothing was sent: try elsewhere
# Events relayed unbatched at a stream's start: SGLang's role-only chat chunk, then the first token's.
_UNBATCHED_EVENTS = 2
# What a broken upstream raises: connection reset/refused, truncated body, per-read timeout.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)


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


@dataclass(slots=True)
class Upstream:
    """An open upstream response whose status and headers are known and whose body is unread."""

    worker: str
    response: aiohttp.ClientResponse
    _eof: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def status_code(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("content-type")

    def headers(self) -> dict[str, str]:
        return {k: v for k, v in self.response.headers.items() if k.lower() not in _SKIP_HEADERS}

    async def read(self) -> bytes:
        """The whole body (raises one of UPSTREAM_ERRORS if the worker breaks off)."""
        return await self.response.read()

    async def chunks(self, batch_interval_s: float = 0.0) -> AsyncIterator[bytes]:
        """The body as it arrives, bytes unchanged (SSE events stay whole and in order).

        With `batch_interval_s` > 0, the first two SSE events go out the moment they arrive —
        SGLang's chat stream opens with a role-only event written just before the first token's,
        so neither the first byte nor the first token is held — and after that, what arrives waits
        until `batch_interval_s` after the previous piece went out and leaves together with
        everything else that came meanwhile. A 12-token reply then leaves the replica (and crosses
        Serve's ingress) as a few pieces instead of one per token, each of which costs CPU. The end
        of the body leaves the moment it arrives, so completion is never delayed.
        """
        content = self.response.content
        events_out = 0
        while True:
            data = await content.readany()
            if not data:
                return
            yield data
            if batch_interval_s <= 0 or content.at_eof():
                continue
            if events_out < _UNBATCHED_EVENTS:
                events_out += data.count(b"\n\n")
                if events_out < _UNBATCHED_EVENTS:
                    continue
            await asyncio.wait((self._eof_future(),), timeout=batch_interval_s)

    def _eof_future(self) -> asyncio.Future[None]:
        if self._eof is None:
            eof = self._eof = asyncio.get_running_loop().create_future()
            self.response.content.on_eof(lambda: eof.done() or eof.set_result(None))
        return self._eof

    async def close(self) -> None:
        """Back to the pool if the body was read to its end; otherwise the connection is closed
        (that is also what tells SGLang to abort a request whose client went away)."""
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


def forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _SKIP_HEADERS and not k.lower().startswith("x-kvroute-")}


class UpstreamClient:
    """Opens requests to workers; raises UpstreamError for failures a retry elsewhere may fix."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        # connect bounds pool wait + TCP connect; sock_read bounds each read (headers, then every chunk)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                              sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None  # made on first use, on the serving loop

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=self._timeout,
                auto_decompress=True,  # a compressed body is decoded, so dropping content-encoding is right
                skip_auto_headers=("Accept-Encoding",),  # and none is asked for
                trust_env=False,  # workers are reached directly, never through an env-configured proxy
            )
        return self._session

    async def open(self, worker: str, method: str, url: str, *, content: bytes | None = None,
                   headers: dict[str, str] | None = None) -> Upstream:
        try:
            resp = await self._client().request(method, url, data=content, headers=headers, allow_redirects=False)
        except asyncio.TimeoutError as exc:
            raise UpstreamError(worker, f"timed out before the response ({type(exc).__name__})",
                                timeout=True) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(worker, f"{type(exc).__name__}: {str(exc)[:120]}") from None
        if resp.status in RETRYABLE_STATUS:
            retry_after = resp.headers.get("retry-after")
            try:
                body = (await resp.content.read(200)).decode("utf-8", "replace")
            except UPSTREAM_ERRORS:
                body = ""
            resp.close()
            raise UpstreamError(worker, f"status {resp.status}: {body}", resp.status, retry_after)
        return Upstream(worker, resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def sse_error_event(message: str, code: str = "upstream_failed") -> bytes:
    """How a stream that broke after it started ends: one OpenAI-style error event, then [DONE]."""
    payload = json.dumps({"error": {"message": message, "type": "server_error", "code": code}})
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
