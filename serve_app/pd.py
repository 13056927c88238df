"""Prefill/decode disaggregation on the request path: pick a pair, inject SGLang's bootstrap fields, drive both.

The protocol (verified against SGLang 0.5.23 and sglang-router's PD router) is written down in
docs/pd.md. In short: the same body, with `bootstrap_host` / `bootstrap_port` (the prefill server's
host and --disaggregation-bootstrap-port) and a random 63-bit `bootstrap_room`, goes to the prefill
and to the decode server at once; the client gets the decode server's response; the prefill
server's response is read to its end and dropped. The pair is chosen by the request's policy
applied to the prefill workers, then to the decode workers (`RouterCore.decide(role=...)`).

Unlike sglang-router, which never looks at the prefill response (it fires and forgets it), kvroute
watches it until the decode side's first byte: a prefill server that fails (refused, reset,
retryable status) leaves its decode peer waiting for a KV cache that never comes (SGLang's
SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s), so the decode request is cancelled and the pair
retried without that worker. A decode side that fails before its first byte is retried the same way.

With attention-DP workers each side's candidates are (worker, rank) targets, and the two bodies
differ: each pins its side's rank, the decode one also names the prefill rank, and the room is
chosen ≡ the prefill rank mod its dp_size (docs/pd.md, "DP ranks in a PD pair").
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Protocol
from urllib.parse import urlsplit

from serve_app.dp_ranks import RANK_HEADER, pd_headers, pd_rank_fields, with_rank_fields
from serve_app.http import HttpError, Request, Send, no_worker, send_body, send_stream
from serve_app.policies import Decision, NoWorkerAvailable, RouteRequest
from serve_app.proxy import UPSTREAM_ERRORS, Upstream, UpstreamClient, UpstreamError, forward_headers, sse_error_event
from serve_app.breaker import Breakers
from serve_app.config import RouterConfig
from serve_app.metrics import RouterMetrics
from serve_app.router import RequestTicket, RouterCore

logger = logging.getLogger("kvroute.router")

PREFILL = "prefill"
DECODE = "decode"
ROOM_MAX = 2**63 - 1  # sglang-router: a random u64 masked to [0, 2^63 - 1] (Python's randint(0, 2**63 - 1))
PREFILL_WORKER_HEADER = "x-kvroute-prefill-worker"
PREFILL_RANK_HEADER = "x-kvroute-prefill-rank"  # the prefill side's attention-DP rank (DP prefill workers only)
PREFILL_BLAME_S = 1.0  # how long a decode stream's opening error waits to learn whether its prefill side failed


# --- the bootstrap fields (pure) ---------------------------------------------------------------


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL, as sglang-router's `get_hostname` takes it (IPv6 without brackets)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"no host in worker URL {url!r}")
    return host


def batch_size(path: str, body: dict[str, Any]) -> int | None:
    """How many requests one body carries, where SGLang wants one bootstrap room per request (None:
    one). As sglang-router counts: chat `n` > 1, a list of completion prompts, and — for /generate —
    a list of texts or of token-id lists."""
    if path.endswith("/chat/completions"):
        n = body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None
    if path.endswith("/completions"):
        p = body.get("prompt")
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else None
    if path.startswith("/generate"):
        t, ids = body.get("text"), body.get("input_ids")
        if isinstance(t, list) and t:
            return len(t)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
    return None


def with_bootstrap(body: dict[str, Any], host: str, port: int | None, rooms: list[int],
                   batch: int | None) -> dict[str, Any]:
    """`body` with the three bootstrap fields set (a copy): scalars for one request, lists of
    `batch` for a batch (`rooms` holds one room per request)."""
    out = dict(body)
    if batch is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=rooms[0])
    else:
        out.update(bootstrap_host=[host] * batch, bootstrap_port=[port] * batch, bootstrap_room=list(rooms))
    return out


def new_rooms(rng: random.Random, batch: int | None, prefill_rank: int | None = None,
              prefill_dp_size: int = 1) -> list[int]:
    """One random room per request in [0, 2^63 - 1]; with a prefill DP rank, each room ≡ that rank
    (mod the prefill server's dp_size): SGLang's prefill server balances by `follow_bootstrap_room`
    by default (`--load-balance-method auto` in PD prefill mode) and fails a request whose routed
    rank differs from `room % dp_size` ("follow_bootstrap_room conflict"), and a decode server
    without `disagg_prefill_dp_rank` looks for the KV on rank `room % dp_size`."""
    if prefill_rank is None or prefill_dp_size <= 1:
        return [rng.randint(0, ROOM_MAX) for _ in range(batch or 1)]
    top = (ROOM_MAX - prefill_rank) // prefill_dp_size
    return [rng.randint(0, top) * prefill_dp_size + prefill_rank for _ in range(batch or 1)]


def pair_bodies(body: dict[str, Any], host: str, port: int | None, rooms: list[int], batch: int | None,
                prefill_rank: int | None, decode_rank: int | None) -> tuple[bytes, bytes]:
    """The prefill and the decode request's JSON: the same bootstrap fields, each side's DP rank
    fields (`serve_app.dp_ranks.pd_rank_fields`; identical bytes when neither side has DP ranks)."""
    base = with_bootstrap(body, host, port, rooms, batch)
    p = json.dumps(with_rank_fields(base, pd_rank_fields(PREFILL, prefill_rank, decode_rank))).encode()
    if prefill_rank is None and decode_rank is None:
        return p, p
    return p, json.dumps(with_rank_fields(base, pd_rank_fields(DECODE, prefill_rank, decode_rank))).encode()


# --- the pair ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PairDecision:
    """The prefill and decode worker chosen for one request."""

    prefill: Decision
    decode: Decision
    bootstrap_port: int | None

    def as_json(self) -> dict[str, Any]:
        """What `/route` says: the decode worker answers the client (`worker`, `rank`), both are named
        with their attention-DP rank (None: no DP ranks)."""
        d, p = self.decode, self.prefill
        return {"worker": d.worker, "rank": d.rank, "url": d.url, "policy": d.policy, "reason": d.reason,
                "disaggregated": True,
                "prefill": {"worker": p.worker, "rank": p.rank, "url": p.url, "reason": p.reason,
                            "bootstrap_host": bootstrap_host(p.url), "bootstrap_port": self.bootstrap_port},
                "decode": {"worker": d.worker, "rank": d.rank, "url": d.url, "reason": d.reason}}


def decode_facts(request: RouteRequest) -> RouteRequest:
    """What the decode side is chosen on: the prompt's size but no prefix affinity — a decode server
    holds no prefix cache of its own (SGLang's --disaggregation-decode-enable-radix-cache is off by
    default): every request's KV arrives from its prefill server."""
    return replace(request, block_hashes=(), token_ids=())


def _side(role: str, choose: Any) -> Any:
    """`choose()`, its NoWorkerAvailable naming the side (a policy's own message does not)."""
    try:
        return choose()
    except NoWorkerAvailable as exc:
        if f"{role} worker" in str(exc):
            raise
        raise NoWorkerAvailable(f"no routable {role} worker: {exc}") from None


def decide_pair(core: RouterCore, request: RouteRequest, policy: str | None, model: str | None,
                exclude: set[str] | frozenset[str] = frozenset()) -> PairDecision:
    """The pair a request would go to (nothing booked). Raises NoWorkerAvailable naming the side."""
    p, _ = _side(PREFILL, lambda: core.decide(request, policy, exclude, model, role=PREFILL))
    d, _ = _side(DECODE, lambda: core.decide(decode_facts(request), policy, exclude, model, role=DECODE))
    return PairDecision(p, d, core.bootstrap_port(p.worker))


def route_pair(core: RouterCore, request: RouteRequest, policy: str | None, model: str | None,
               exclude: set[str] | frozenset[str] = frozenset()) -> tuple[RequestTicket, RequestTicket]:
    """Decide and book both sides in the ledger (the prefill ticket carries the prefix overlap, the
    decode ticket none). Raises NoWorkerAvailable (nothing stays booked)."""
    prefill = _side(PREFILL, lambda: core.route(request, policy, exclude, model, role=PREFILL))
    try:
        decode = _side(DECODE, lambda: core.route(decode_facts(request), policy, exclude, model, role=DECODE))
    except BaseException:
        prefill.failed()
        raise
    return prefill, decode


# --- dispatch ------------------------------------------------------------------------------------


class _Retry(Exception):
    """One side failed before the decode side's first byte: try another pair without `worker`."""

    def __init__(self, side: str, worker: str, detail: str, retry_after: str | None = None) -> None:
        super().__init__(f"{side} worker {worker}: {detail}")
        self.worker = worker
        self.retry_after = retry_after


class _Answered(Exception):
    """The client already has its answer (the prefill side's error status)."""


def _sse_error(body: bytes) -> bool:
    return body.startswith(b"data: ") and b'data: {"error"' in body


class PdHost(Protocol):
    """What `PdDispatch` uses of the replica's request path (`serve_app.forward.Forwarder`)."""

    core: RouterCore
    config: RouterConfig
    breakers: Breakers
    metrics: RouterMetrics
    upstream: UpstreamClient

    def _finished(self, ticket: RequestTicket, t0: float, status: int, policy: str, model: str = "") -> None: ...

    def _failed(self, ticket: RequestTicket, counts_for_breaker: bool) -> None: ...


class PdDispatch:
    """Drives prefill/decode pairs for one router replica (a part of `Forwarder`)."""

    def __init__(self, fw: PdHost) -> None:
        self.fw = fw
        self.rng = random.Random()  # rooms must differ across replicas: never the router's seeded rng
        self._background: set[asyncio.Task[None]] = set()

    async def forward(self, request: Request, send: Send, path: str, body: dict[str, Any], facts: RouteRequest,
                      policy: str, model: str | None) -> None:
        fw, m = self.fw, self.fw.metrics
        headers = forward_headers(request.headers)
        headers["content-type"] = "application/json"
        batch = batch_size(path, body)
        tried: set[str] = set()
        failures: list[str] = []
        retry_after: str | None = None
        label = fw.core.metric_model(model)
        for attempt in range(fw.config.max_attempts):
            try:
                prefill, decode = route_pair(fw.core, facts, policy, model, tried | fw.breakers.blocked())
            except NoWorkerAvailable as exc:
                if not failures:
                    m.requests.labels(policy, label, "", "no_worker").inc()
                    raise no_worker(exc, fw.breakers.blocked()) from None
                break
            port = fw.core.bootstrap_port(prefill.worker)
            p_rank, d_rank = prefill.decision.rank, decode.decision.rank
            rooms = new_rooms(self.rng, batch, p_rank, len(fw.core.targets(prefill.worker)))
            raws = pair_bodies(body, bootstrap_host(prefill.url), port, rooms, batch, p_rank, d_rank)
            hdrs = headers if p_rank is None and d_rank is None else pd_headers(headers)
            try:
                await self._attempt(send, path, raws, hdrs, prefill, decode, policy, body.get("stream") is True, label)
                return
            except _Retry as exc:
                tried.add(exc.worker)
                failures.append(str(exc))
                retry_after = exc.retry_after or retry_after
                m.retries.labels(exc.worker).inc()
                logger.info("PD attempt %d (prefill %s, decode %s, room %d) failed before the first byte: %s",
                            attempt + 1, prefill.decision.target or prefill.worker,
                            decode.decision.target or decode.worker, rooms[0], exc)
                await asyncio.sleep(min(0.5, 0.02 * (2**attempt)) * random.uniform(0.5, 1.5))
        m.requests.labels(policy, label, "", "unavailable").inc()
        raise HttpError(503, f"no prefill/decode pair could serve the request after {len(failures)} attempt(s): "
                        + "; ".join(failures[-3:]), code="upstream_unavailable",
                        headers={"retry-after": retry_after or "1"})

    async def _attempt(self, send: Send, path: str, raws: tuple[bytes, bytes], headers: dict[str, str],
                       prefill: RequestTicket, decode: RequestTicket, policy: str, stream: bool,
                       model: str = "") -> None:
        """One pair: both requests at once (`raws`: the prefill and the decode body); relay decode's
        answer once its first byte is in. Raises _Retry if either side fails before that (both
        tickets ended, both connections closed)."""
        fw = self.fw
        p_raw, raw = raws
        for t in (prefill, decode):
            fw.breakers.on_dispatch(t.worker)
        t0 = time.perf_counter()
        # the prefill side: its whole answer (tiny: one token), which comes once its KV is handed over
        p_task = asyncio.ensure_future(self._prefill_call(prefill, prefill.url + path, p_raw, headers))
        d_task = asyncio.ensure_future(fw.upstream.open(decode.worker, "POST", decode.url + path, content=raw,
                                                        headers=headers))
        first: asyncio.Future[Any] | None = None
        up: Upstream | None = None
        chunks: AsyncIterator[bytes] | None = None
        prefill_done = False
        try:
            while True:
                waiting = {d_task if first is None else first}
                if not prefill_done:
                    waiting.add(p_task)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not prefill_done and p_task.done():
                    status, p_headers, p_body = p_task.result()  # raises _Retry: the prefill side failed
                    prefill_done = True
                    if status >= 400:  # a client error the decode side may never see: the client's answer
                        prefill.finished()
                        await send_body(send, status, p_body, content_type=None,
                                        headers={**p_headers, PREFILL_WORKER_HEADER: prefill.worker})
                        raise _Answered
                    prefill.finished()
                    fw.breakers.on_success(prefill.worker)
                if first is None and d_task.done():
                    try:
                        up = d_task.result()
                    except UpstreamError as exc:
                        self._breaker(decode.worker, exc.counts_for_breaker)
                        raise _Retry(DECODE, decode.worker, str(exc).split(": ", 1)[-1], exc.retry_after) from None
                    if up.status_code >= 400 or not stream:  # a whole body (an error status is not retryable)
                        first = asyncio.ensure_future(up.read())
                    else:
                        chunks = up.chunks(fw.config.stream_batching_interval_ms / 1e3,
                                           hold_reads=fw.config.stream_batching_hold_reads)
                        first = asyncio.ensure_future(chunks.__anext__())
                    continue
                if first is not None and first.done():
                    break
            try:
                piece = first.result()
            except StopAsyncIteration:
                piece = b""
            except UPSTREAM_ERRORS as exc:
                self._breaker(decode.worker, True)
                raise _Retry(DECODE, decode.worker, f"{type(exc).__name__} before the first byte") from None
            if chunks is not None and _sse_error(piece):
                # SGLang's decode side reports a failed KV handoff as a stream that opens with an error
                # event: nothing useful reached the client yet. Blame the prefill side if it failed too.
                if not prefill_done:
                    await asyncio.wait({p_task}, timeout=PREFILL_BLAME_S)
                    if p_task.done() and isinstance(p_task.exception(), _Retry):
                        p_task.result()
                raise _Retry(DECODE, decode.worker, "its stream opened with an error event: "
                             + piece[piece.find(b'{"error"'):][:160].decode("utf-8", "replace"))
        except BaseException as exc:
            for task in (d_task, first) if prefill_done else (d_task, first, p_task):
                if task is not None:
                    await _discard(task)
            if up is not None:
                await up.close()
            if not prefill_done:
                prefill.failed()
            if isinstance(exc, _Answered):
                decode.failed()
                return
            decode.failed()
            raise
        # the decode side's first byte is in: from here on the client gets what it sends
        decode.first_token()
        fw.metrics.ttft_seconds.labels(decode.worker).observe(time.perf_counter() - t0)
        if not prefill_done:  # its answer is late: settled in the background
            self._spawn(self._settle_prefill(p_task, prefill))
        out_headers = up.headers()
        out_headers["x-kvroute-worker"] = decode.worker
        out_headers[PREFILL_WORKER_HEADER] = prefill.worker
        if decode.decision.rank is not None:
            out_headers[RANK_HEADER] = str(decode.decision.rank)
        if prefill.decision.rank is not None:
            out_headers[PREFILL_RANK_HEADER] = str(prefill.decision.rank)
        if chunks is None:  # a whole body (non-streamed, or an error status)
            await up.close()
            fw._finished(decode, t0, up.status_code, policy, model)
            await send_body(send, up.status_code, piece, content_type=None, headers=out_headers)
            return
        if up.content_type:
            out_headers.pop("content-type", None)
        await send_stream(send, up.status_code, self._relay(piece, chunks, up, decode, t0, policy, model),
                          content_type=up.content_type or "text/event-stream", headers=out_headers)

    async def _prefill_call(self, ticket: RequestTicket, url: str, raw: bytes,
                            headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """The prefill request, read to its end: (status, headers, body). Raises _Retry when it fails:
        refused, reset or cut short, a retryable status, or — on a stream — SGLang's error event
        (a failed KV handoff is reported that way once the 200 has gone out)."""
        try:
            up = await self.fw.upstream.open(ticket.worker, "POST", url, content=raw, headers=headers)
        except UpstreamError as exc:
            self._breaker(ticket.worker, exc.counts_for_breaker)
            raise _Retry(PREFILL, ticket.worker, str(exc).split(": ", 1)[-1], exc.retry_after) from None
        try:
            ticket.first_token()  # headers in: a streamed prefill answer's body follows its transfer
            body = await up.read()
        except UPSTREAM_ERRORS as exc:
            self._breaker(ticket.worker, True)
            raise _Retry(PREFILL, ticket.worker, f"{type(exc).__name__} before its answer ended") from None
        finally:
            await up.close()
        if up.status_code < 400 and _sse_error(body):
            raise _Retry(PREFILL, ticket.worker, "its stream ended with an error event: "
                         + body[body.find(b'{"error"'):][:160].decode("utf-8", "replace"))
        return up.status_code, up.headers(), body

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], up: Upstream, ticket: RequestTicket,
                     t0: float, policy: str, model: str = "") -> AsyncIterator[bytes]:
        """The decode side's stream, its first piece already read; a break ends it with an error event."""
        outcome = "cancelled"
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
            outcome = "ok"
        except UPSTREAM_ERRORS as exc:
            outcome = "broken"
            logger.warning("stream from decode worker %s broke after it started: %s", ticket.worker,
                           type(exc).__name__)
            yield sse_error_event(f"decode worker {ticket.worker} failed mid-stream ({type(exc).__name__})")
        finally:
            await up.close()
            if outcome == "ok":
                self.fw._finished(ticket, t0, up.status_code, policy, model)
            else:
                self.fw._failed(ticket, outcome == "broken")
                self.fw.metrics.requests.labels(policy, model, ticket.worker, outcome).inc()

    async def _settle_prefill(self, task: asyncio.Future[Any], ticket: RequestTicket) -> None:
        """The prefill answer after the decode side's first byte (its KV is in): end its ticket."""
        try:
            status, _, _ = await task
        except _Retry as exc:
            ticket.failed()
            logger.info("after its decode peer started: %s", exc)
            return
        except BaseException:
            ticket.failed()
            raise
        ticket.finished()
        if status < 400:
            self.fw.breakers.on_success(ticket.worker)

    def _breaker(self, worker: str, counts: bool) -> None:
        if counts and self.fw.breakers.on_failure(worker):
            self.fw.metrics.breaker_opened.labels(worker).inc()
            logger.warning("worker %s: circuit breaker opened", worker)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _discard(task: asyncio.Future[Any]) -> None:
    """Cancel an upstream open/read; close what it opened (that is what makes SGLang abort the request)."""
    if not task.done():
        task.cancel()
    try:
        result = await task
    except BaseException:
        return
    if isinstance(result, Upstream):
        await result.close()
