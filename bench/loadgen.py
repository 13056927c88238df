"""Open-loop load generator (asyncio + aiohttp, streaming chat completions) and a closed-loop one.

aiohttp, not httpx: its HTTP parser is C (httpx's h11 is pure Python), which cut the load
generator's CPU per streamed request several-fold — the generator must never be what saturates the
machine (`bench.cpu` reports its share per trial).

Every request is a streamed `/v1/chat/completions` with `stream_options.include_usage`, so each
response tells us its engine's `prompt_tokens_details.cached_tokens`. Times are wall-clock
(`loop.time()`), measured in this process:

- TTFT: request sent → first SSE chunk that carries generated text. (The simulated server, like
  many servers, sends an empty `role` chunk before prefill; that chunk is not a token.)
- ITL: gaps between consecutive text chunks of one response.
- E2E: request sent → `[DONE]` (or end of body).

Open loop: every session starts at its trace offset whether or not earlier requests finished; a
multi-turn session sends turn k+1 its think time after turn k's reply ended (it must contain it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from bench.workloads import Session, Trace, build_messages

try:  # faster JSON for the SSE parse loop when available (Ray brings it)
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads

WORKER_HEADERS = ("x-kvroute-worker", "x-bench-worker")


@dataclass(frozen=True)
class Target:
    """Where a load generator sends requests: one router URL, or several worker URLs picked
    round-robin by the client itself (the `direct` floor). `by_model`: for a multi-model fleet,
    the URLs that serve each model (a router per model, or the model's own workers for `direct`);
    a request naming a model picks among those. `run_closed(model=…)` names the model its bodies ask for."""

    name: str
    urls: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)
    label: str = ""
    notes: str = ""
    by_model: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def endpoint(self, i: int, model: str | None = None) -> str:
        urls = self.urls
        if self.by_model:
            if model not in self.by_model:
                raise KeyError(f"target {self.name} serves models {sorted(self.by_model)}, not {model!r}")
            urls = self.by_model[model]
        return urls[i % len(urls)] + "/v1/chat/completions"


@dataclass(slots=True)
class RequestResult:
    sid: str
    turn: int
    group: int | None
    sched_s: float  # when the trace wanted it sent (offset; turns > 0: previous end + think time)
    sent_s: float  # when it was sent (offset from the trace start)
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0  # text chunks received
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    worker: str | None = None
    reply: str = ""

    def as_row(self) -> dict[str, Any]:
        return {
            "sid": self.sid, "turn": self.turn, "group": self.group, "sched_s": round(self.sched_s, 4),
            "sent_s": round(self.sent_s, 4), "ok": self.ok, "status": self.status, "error": self.error,
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1e3, 3),
            "e2e_ms": None if self.e2e_s is None else round(self.e2e_s * 1e3, 3),
            "tokens": self.tokens, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "worker": self.worker,
        }


def make_client(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=timeout_s),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),  # no pool limit: open loop
        trust_env=False,  # loopback only: never a proxy from the environment
        auto_decompress=False,
    )


def chat_body(messages: list[dict[str, str]], max_tokens: int, model: str = "default") -> bytes:
    return json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()


async def stream_chat(client: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                      res: RequestResult, clock: Callable[[], float]) -> None:
    """Send one streamed chat request and fill `res` (times relative to the send)."""
    t0 = clock()
    last = None
    parts: list[str] = []
    try:
        async with client.post(url, data=body, headers={"content-type": "application/json", **headers}) as resp:
            res.status = resp.status
            for h in WORKER_HEADERS:
                if h in resp.headers:
                    res.worker = resp.headers[h]
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:160].decode('utf-8', 'replace')}"
                return
            buf = b""
            done = False
            async for chunk in resp.content.iter_any():
                now = clock()
                buf += chunk
                while True:
                    i = buf.find(b"\n\n")
                    if i < 0:
                        break
                    event, buf = buf[:i], buf[i + 2:]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            continue
                        obj = _loads(data)
                        if "error" in obj and not obj.get("choices"):
                            res.error = f"stream error: {str(obj['error'])[:160]}"
                            continue
                        for ch in obj.get("choices") or ():
                            text = (ch.get("delta") or {}).get("content")
                            if text:
                                if last is None:
                                    res.ttft_s = now - t0
                                else:
                                    res.itl_s.append(now - last)
                                last = now
                                res.tokens += 1
                                parts.append(text)
                        usage = obj.get("usage")
                        if usage:
                            res.prompt_tokens = usage.get("prompt_tokens")
                            res.completion_tokens = usage.get("completion_tokens")
                            res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            res.e2e_s = clock() - t0
            if res.error is None and not done:
                res.error = "stream ended without [DONE]"
            res.ok = res.error is None and res.tokens > 0
            if not res.ok and res.error is None:
                res.error = "no tokens"
    except asyncio.TimeoutError as exc:
        res.error = f"timeout ({type(exc).__name__})"
    except (aiohttp.ClientError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {str(exc)[:120]}"
    finally:
        res.reply = "".join(parts)


async def run_trace(trace: Trace, target: Target, *, timeout_s: float = 60.0, drain_s: float = 60.0) -> tuple[list[RequestResult], float]:
    """Drive `trace` open-loop against `target`. Returns (results, wall seconds). Requests still
    open `drain_s` after the last session start are cancelled and count as errors."""
    loop = asyncio.get_running_loop()
    results: list[RequestResult] = []
    rr: dict[str, itertools.count] = {}  # round-robin position per model (`direct` over each model's workers)
    async with make_client(timeout_s) as client:
        t0 = loop.time() + 0.05

        def clock() -> float:
            return loop.time()

        async def session(s: Session) -> None:
            replies: list[str] = []
            sched = s.start_s
            delay = t0 + sched - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            for k, turn in enumerate(s.turns):
                if k:
                    sched = (loop.time() - t0) + turn.gap_s
                    await asyncio.sleep(turn.gap_s)
                res = RequestResult(s.sid, k, s.group, sched, loop.time() - t0)
                results.append(res)
                body = chat_body(build_messages(s, k, replies), turn.max_tokens, s.model)
                await stream_chat(client, target.endpoint(next(rr.setdefault(s.model, itertools.count())), s.model), body, target.headers, res, clock)
                if not res.ok:
                    return  # a conversation does not continue past a failed turn
                replies.append(res.reply)

        tasks = [asyncio.create_task(session(s)) for s in trace.sessions]
        last_start = max((s.start_s for s in trace.sessions), default=0.0)
        _done, pending = await asyncio.wait(tasks, timeout=last_start + drain_s + 0.1)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = loop.time() - t0
    for r in results:
        if not r.ok and r.error is None:
            r.error = "cancelled at the drain deadline"
        r.reply = ""  # replies are only needed inside the session
    return results, wall


async def run_closed(target: Target, concurrency: int, n_requests: int, make_body: Callable[[int], bytes],
                     *, timeout_s: float = 60.0, model: str | None = None) -> tuple[list[RequestResult], float]:
    """`concurrency` clients send requests back-to-back until `n_requests` measured ones were sent;
    each client's first request is a warm-up (not measured). Returns (measured results, seconds from
    the first measured send to the last measured end)."""
    loop = asyncio.get_running_loop()
    results: list[RequestResult] = []
    seq = itertools.count()
    issued = itertools.count()
    async with make_client(timeout_s) as client:
        t0 = loop.time()

        async def worker() -> None:
            first = True
            while first or next(issued) < n_requests:
                i = next(seq)
                res = RequestResult(f"c{i}", 0, None, loop.time() - t0, loop.time() - t0)
                await stream_chat(client, target.endpoint(i, model), make_body(i), target.headers, res, loop.time)
                res.reply = ""
                if not first:
                    results.append(res)
                first = False

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if not results:
        return results, 0.0
    start = min(r.sent_s for r in results)
    end = max(r.sent_s + (r.e2e_s or 0.0) for r in results)
    return results, end - start


__all__ = ["Target", "RequestResult", "run_trace", "run_closed", "chat_body", "make_client", "stream_chat"]
