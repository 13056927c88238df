"""Upstream HTTP to SGLang workers: one pooled httpx client per replica, streaming pass-through."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx

# Hop-by-hop and framing headers we must not copy between the two connections.
_SKIP_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-authenticate", "authorization", "accept-encoding",
    "content-encoding", "date", "server",
}
RETRYABLE_STATUS = {429, 500, 502, 503, 504}  # before the first byte nothing was sent: try elsewhere


class UpstreamError(Exception):
    """The worker failed before sending a first byte (connect error, reset, retryable status)."""

    def __init__(self, worker: str, detail: str, status: int | None = None, retry_after: str | None = None):
        super().__init__(f"worker {worker}: {detail}")
        self.worker = worker
        self.status = status
        self.retry_after = retry_after


@dataclass(slots=True)
class Upstream:
    """An open upstream response whose status and headers are known and whose body is unread."""

    worker: str
    response: httpx.Response

    @property
    def status_code(self) -> int:
        return self.response.status_code

    def headers(self) -> dict[str, str]:
        return {k: v for k, v in self.response.headers.items() if k.lower() not in _SKIP_HEADERS}

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.aiter_raw():
            if chunk:
                yield chunk

    async def close(self) -> None:
        await self.response.aclose()


def forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _SKIP_HEADERS and not k.lower().startswith("x-kvroute-")}


class UpstreamClient:
    """Opens requests to workers; raises UpstreamError for failures a retry elsewhere may fix."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=30),
            follow_redirects=False,
        )

    async def open(
        self, worker: str, method: str, url: str, *, content: bytes | None = None, headers: dict[str, str] | None = None,
        first_byte_timeout_s: float | None = None,
    ) -> Upstream:
        req = self._client.build_request(method, url, content=content, headers=headers)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamError(worker, f"timed out before the response ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(worker, f"{type(exc).__name__}: {str(exc)[:120]}") from None
        if resp.status_code in RETRYABLE_STATUS:
            retry_after = resp.headers.get("retry-after")
            body = (await resp.aread())[:200].decode("utf-8", "replace")
            await resp.aclose()
            raise UpstreamError(worker, f"status {resp.status_code}: {body}", resp.status_code, retry_after)
        return Upstream(worker, resp)

    async def aclose(self) -> None:
        await self._client.aclose()


def sse_error_event(message: str, code: str = "upstream_failed") -> bytes:
    """How a stream that broke after it started ends: one OpenAI-style error event, then [DONE]."""
    payload = json.dumps({"error": {"message": message, "type": "server_error", "code": code}})
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
