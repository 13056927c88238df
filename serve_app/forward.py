"""Forwarding one OpenAI/SGLang request: decide, dispatch, retry before the first byte, relay.

A request is routed by `RouterCore`, sent with `UpstreamClient`, and retried on another worker
while nothing has reached the client (connect errors, resets, retryable statuses — each attempt
excludes the workers already tried and those whose breaker is open). Once a streamed reply has
started, a break ends it with one SSE error event. Streamed bytes are relayed as they come,
never parsed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, AsyncIterator

from serve_app.breaker import Breakers
from serve_app.config import RouterConfig
from serve_app.dp_ranks import RANK_HEADER, pinned_body, pinned_headers
from serve_app.http import HttpError, Request, Send, no_worker, send_body, send_json, send_stream
from serve_app.metrics import RouterMetrics
from serve_app.pd import PdDispatch
from serve_app.policies import NoWorkerAvailable, UnknownPolicy
from serve_app.proxy import UPSTREAM_ERRORS, Upstream, UpstreamClient, UpstreamError, forward_headers, sse_error_event
from serve_app.request_facts import InvalidRequestBody
from serve_app.router import ModelRequired, RequestTicket, RouterCore, UnknownModel

logger = logging.getLogger("kvroute.router")

POLICY_HEADER = "x-kvroute-policy"
WORKER_HEADER = "x-kvroute-worker"


class Forwarder:
    """The request path of one router replica."""

    def __init__(self, core: RouterCore, upstream: UpstreamClient, breakers: Breakers, metrics: RouterMetrics,
                 config: RouterConfig) -> None:
        self.core = core
        self.upstream = upstream
        self.breakers = breakers
        self.metrics = metrics
        self.config = config
        self.pd = PdDispatch(self)  # prefill/decode pairs (docs/pd.md)

    def routing_input(self, request: Request, body: dict[str, Any]) -> tuple[Any, str, str | None]:
        """Routing facts, policy name and model (`RouterCore.resolve_model`) of a request, or its
        400 / 404 (a model no worker serves: OpenAI's `model_not_found`)."""
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise HttpError(400, "model: must be a string", code="invalid_body")
        try:
            model = self.core.resolve_model(name)
            return self.core.facts(body), self.core.policy(request.headers.get(POLICY_HEADER)).name, model
        except UnknownModel as exc:
            raise HttpError(404, str(exc), code="model_not_found") from None
        except ModelRequired as exc:
            raise HttpError(400, str(exc), code="model_required") from None
        except InvalidRequestBody as exc:
            raise HttpError(400, str(exc), code="invalid_body") from None
        except RecursionError:
            raise HttpError(400, "body is nested too deeply", code="invalid_body") from None
        except UnknownPolicy as exc:
            raise HttpError(400, str(exc), code="unknown_policy") from None

    async def forward(self, request: Request, send: Send, path: str, raw: bytes, body: dict[str, Any]) -> None:
        facts, policy, model = self.routing_input(request, body)
        if self.core.disaggregated(model):
            await self.pd.forward(request, send, path, body, facts, policy, model)
            return
        label = self.core.metric_model(model)
        stream = body.get("stream") is True
        headers = forward_headers(request.headers)
        tried: set[str] = set()
        failures: list[str] = []
        retry_after: str | None = None
        m = self.metrics
        if stream and self.core.should_hold(facts, policy, self.breakers.blocked(), model):  # serve_app.admission
            m.admission_held_seconds.observe(await self.core.admission.hold())
        for attempt in range(self.config.max_attempts):
            t_decide = time.perf_counter()
            try:
                ticket = self.core.route(facts, policy, exclude=tried | self.breakers.blocked(), model=model,
                                         streamed=stream)
            except NoWorkerAvailable as exc:
                if not failures:
                    m.requests.labels(policy, label, "", "no_worker").inc()
                    raise no_worker(exc, self.breakers.blocked()) from None
                break
            t0 = time.perf_counter()
            m.decision_seconds.observe(t0 - t_decide)
            d, facts = ticket.decision, ticket.request
            self.breakers.on_dispatch(d.worker)
            content, hdrs = raw, headers
            if d.rank is not None:  # a DP worker: pin the rank the ledger booked (serve_app.dp_ranks)
                content, hdrs = pinned_body(body, d.rank), pinned_headers(headers)
            try:
                up = await self.upstream.open(d.worker, "POST", d.url + path, content=content, headers=hdrs)
            except UpstreamError as exc:
                self._failed(ticket, exc.counts_for_breaker)
                tried.add(d.worker)
                failures.append(str(exc))
                retry_after = exc.retry_after or retry_after
                m.retries.labels(d.worker).inc()
                logger.info("attempt %d on %s%s failed before first byte: %s", attempt + 1, d.worker,
                            "" if d.rank is None else f" rank {d.rank}", exc)
                await asyncio.sleep(min(0.5, 0.02 * (2**attempt)) * random.uniform(0.5, 1.5))
                continue
            except asyncio.CancelledError:  # client went away before the worker answered
                ticket.failed()
                raise
            out_headers = up.headers()
            out_headers[WORKER_HEADER] = d.worker
            if d.rank is not None:
                out_headers[RANK_HEADER] = str(d.rank)
            if not stream:
                try:
                    content = await up.read()
                except UPSTREAM_ERRORS as exc:  # died mid-body: nothing sent yet, so retry elsewhere
                    self._failed(ticket, True)
                    tried.add(d.worker)
                    m.retries.labels(d.worker).inc()
                    failures.append(f"worker {d.worker}: {type(exc).__name__} while reading the body")
                    continue
                finally:
                    await up.close()
                self._finished(ticket, t0, up.status_code, policy, label)
                await send_body(send, up.status_code, content, content_type=None, headers=out_headers)
                return
            if up.content_type:
                out_headers.pop("content-type", None)
            await send_stream(send, up.status_code, self._relay(up, ticket, t0, policy, label),
                              content_type=up.content_type or "text/event-stream", headers=out_headers,
                              last=lambda: up.at_eof)
            return
        m.requests.labels(policy, label, "", "unavailable").inc()
        raise HttpError(
            503,
            f"no worker could serve the request after {len(failures)} attempt(s): " + "; ".join(failures[-3:]),
            code="upstream_unavailable",
            headers={"retry-after": retry_after or "1"},
        )

    def _failed(self, ticket: RequestTicket, counts_for_breaker: bool) -> None:
        ticket.failed()
        worker = ticket.worker
        if counts_for_breaker and self.breakers.on_failure(worker):
            self.metrics.breaker_opened.labels(worker).inc()
            logger.warning("worker %s: circuit breaker opened", worker)

    def _finished(self, ticket: RequestTicket, t0: float, status: int, policy: str, model: str = "") -> None:
        ticket.finished()
        worker = ticket.worker
        self.breakers.on_success(worker)
        self.metrics.duration_seconds.labels(worker).observe(time.perf_counter() - t0)
        self.metrics.requests.labels(policy, model, worker, "ok" if status < 400 else f"http_{status}").inc()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("routed to %s (%s), answered %d in %.1f ms", ticket.decision.target or worker,
                         ticket.decision.reason, status,
                         (time.perf_counter() - t0) * 1e3)

    async def _relay(self, up: Upstream, ticket: RequestTicket, t0: float, policy: str,
                     model: str = "") -> AsyncIterator[bytes]:
        """Pass SSE chunks through as they arrive; a break after the start ends with an error event."""
        worker = ticket.worker
        first = True
        outcome = "cancelled"
        try:
            async for chunk in up.chunks(self.config.stream_batching_interval_ms / 1e3,
                                              hold_reads=self.config.stream_batching_hold_reads):
                if first:
                    ticket.first_token()
                    self.metrics.ttft_seconds.labels(worker).observe(time.perf_counter() - t0)
                    first = False
                yield chunk
            outcome = "ok"
        except UPSTREAM_ERRORS as exc:
            outcome = "broken"
            logger.warning("stream from %s broke after it started: %s", worker, type(exc).__name__)
            yield sse_error_event(f"worker {worker} failed mid-stream ({type(exc).__name__})")
        finally:
            await up.close()
            if outcome == "ok":
                self._finished(ticket, t0, up.status_code, policy, model)
            else:
                self._failed(ticket, outcome == "broken")
                self.metrics.requests.labels(policy, model, worker, outcome).inc()

    async def models(self, send: Send, workers: dict[str, Any]) -> None:
        """`GET /v1/models`: every model the fleet serves, from the fleet view (OpenAI's list shape).
        Only a fleet whose workers declare no model asks a healthy worker (tried in random order)."""
        served = self.core.served_models()
        if served:
            await send_json(send, 200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "kvroute",
                 "workers": self.core.declaring(m)} for m in served]})
            return
        healthy = [r for r in workers.values() if r.state != "down" and r.healthy]
        random.shuffle(healthy)
        for rec in healthy[: self.config.max_attempts]:
            try:
                up = await self.upstream.open(rec.name, "GET", f"{rec.url}/v1/models")
            except UpstreamError:
                continue
            try:
                content = await up.read()
            except UPSTREAM_ERRORS:
                continue
            finally:
                await up.close()
            await send_body(send, up.status_code, content, headers={WORKER_HEADER: rec.name})
            return
        raise HttpError(503, "no healthy worker to answer /v1/models", code="no_worker", headers={"retry-after": "1"})
