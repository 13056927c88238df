"""The router's HTTP layer on raw ASGI: requests, responses and OpenAI-shaped errors.

The router replica speaks ASGI directly (Ray Serve's `@serve.ingress()` with
`__serve_build_asgi_app__`, no FastAPI/Starlette in between): a streamed reply passes through one
`send` per relayed piece instead of a stack of middleware wrappers, which is most of what a Python
framework costs per request here (see docs/benchmarks.md, "request path").
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]


class HttpError(Exception):
    """An answer that is an error: OpenAI's error shape, `type` by status class."""

    def __init__(self, status: int, message: str, *, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        # OpenAI's error object has all four keys (`param` null where no one parameter is at fault):
        # SDKs read `error.param`, and some clients match the whole shape
        return json.dumps({"error": {"message": self.message, "type": kind, "param": None,
                                     "code": self.code}}).encode()


def no_worker(exc: Exception, open_breakers: Any) -> HttpError:
    """The 503 for a request no worker can take now, naming the workers whose breaker is open."""
    return HttpError(503, f"{exc}; open breakers: {sorted(open_breakers) or 'none'}",
                     code="no_worker", headers={"retry-after": "1"})


class Request:
    """One HTTP request: method, path below the app's route prefix, lower-cased headers."""

    __slots__ = ("scope", "method", "path", "raw_headers", "headers", "_receive")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.method: str = scope["method"]
        root = scope.get("root_path", "")
        path: str = scope["path"]
        self.path = path[len(root):] if root and path.startswith(root) else path
        self.raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        # latin-1 as HTTP/1.1 carries them; a repeated header keeps its last value (forwarded
        # headers are then exactly one per name)
        self.headers: dict[str, str] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw_headers}
        self._receive = receive

    def header_bytes(self) -> int:
        return sum(len(k) + len(v) for k, v in self.raw_headers)

    async def body(self, limit: int) -> bytes:
        """The whole body; `HttpError(413)` beyond `limit` bytes (declared or received)."""
        declared = self.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body larger than {limit} bytes", code="body_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, f"request body larger than {limit} bytes", code="body_too_large")
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def _headers(headers: dict[str, str] | None, content_type: str | None) -> list[tuple[bytes, bytes]]:
    out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if content_type is not None:
        out.append((b"content-type", content_type.encode("latin-1")))
    return out


async def send_body(send: Send, status: int, body: bytes, *, content_type: str | None = "application/json",
                    headers: dict[str, str] | None = None) -> None:
    hdrs = _headers(headers, content_type)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
    await send_body(send, status, json.dumps(obj).encode(), headers=headers)


async def send_error(send: Send, err: HttpError) -> None:
    await send_body(send, err.status, err.body(), headers=err.headers)


async def send_stream(send: Send, status: int, pieces: AsyncIterator[bytes], *, content_type: str,
                      headers: dict[str, str] | None = None, last: Callable[[], bool] | None = None) -> None:
    """A streamed body (chunked transfer), each piece sent as it comes. `last()`, asked after each
    piece arrives, says whether it ends the body: it then goes out with the end of the response in
    one message (one write) instead of a piece and an empty end."""
    await send({"type": "http.response.start", "status": status, "headers": _headers(headers, content_type)})
    async for piece in pieces:
        if last is not None and last():
            await send({"type": "http.response.body", "body": piece})
            async for extra in pieces:  # `last` said the end: nothing should follow, but never drop bytes
                raise RuntimeError(f"a piece of {len(extra)} bytes followed the last one")
            return
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def lifespan(receive: Receive, send: Send) -> None:
    """ASGI lifespan: nothing to start or stop (the deployment's constructor did it)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
