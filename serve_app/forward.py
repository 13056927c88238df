"""Forwarding one OpenAI/SGLang request: decide, dispatch, retry before the first byte, relay.

A request is routed by `RouterCore`, sent with `UpstreamClient`, and retried on another worker
while nothing has reached the client (connect errors, resets, retryable statuses — each attempt
excludes the workers already tried and those whose breaker is open). Once a streamed reply has
started, a break ends it with one SSE error event. Streamed bytes are relayed as they come,
never parsed; only the engine's usage (its `cached_tokens`) is read from the answer, to check
the router's predicted reuse (`serve_app.usage`, `serve_app.prediction`).
"""

from __future__ import annotations

import asyncio
import json
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
from serve_app.usage import Usage, UsageStrip, body_usage, stream_usage, wants_stream_usage, with_stream_usage

logger = logging.getLogger("kvroute.router")

POLICY_HEADER = "x-kvroute-policy"
WORKER_HEADER = "x-kvroute-worker"
EXPLAIN_HEADER = "x-kvroute-explain"  # request: "1" asks for the route receipt
ROUTE_HEADER = "x-kvroute-route"  # response: the route receipt, compact JSON
_USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")  # where a stream's usage chunk can be asked for


def receipt_header(receipt: dict[str, Any]) -> str:
    """The receipt as a header value: compact JSON, ASCII only."""
    return json.dumps(receipt, separators=(",", ":"))


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

    def routing_input(self, request: Request, body: dict[str, Any]) -> tuple[Any, str, str | None, str | None]:
        """Routing facts, policy name, model and LoRA adapter (`RouterCore.resolve`) of a request, or
        its 400 / 404 (a model no worker serves: OpenAI's `model_not_found`)."""
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise HttpError(400, "model: must be a string", code="invalid_body")
        try:
            model, adapter = self.core.resolve(name, body)
            return self.core.facts(body), self.core.policy(request.headers.get(POLICY_HEADER)).name, model, adapter
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
        facts, policy, model, adapter = self.routing_input(request, body)
        if self.core.disaggregated(model):
            await self.pd.forward(request, send, path, body, facts, policy, model)
            return
        label = self.core.metric_model(model)
        stream = body.get("stream") is True
        explain = request.headers.get(EXPLAIN_HEADER) == "1"
        headers = forward_headers(request.headers)  # (x-kvroute-* headers stay here)
        # a stream's usage (the engine's cached_tokens) is in its final chunk: asked for upstream when
        # the client did not, and that chunk is then taken out of the relayed stream
        strip = stream and self.config.prediction_check.enabled and path in _USAGE_PATHS \
            and not wants_stream_usage(body)
        send_raw, send_body_obj = with_stream_usage(raw, body) if strip else (raw, body)
        tried: set[str] = set()
        failures: list[str] = []
        retry_after: str | None = None
        m = self.metrics
        if stream and self.core.should_hold(facts, policy, self.breakers.blocked(), model, adapter):  # serve_app.admission
            m.admission_held_seconds.observe(await self.core.admission.hold())
        for attempt in range(self.config.max_attempts):
            t_decide = time.perf_counter()
            try:
                ticket = self.core.route(facts, policy, exclude=tried | self.breakers.blocked(), model=model,
                                         streamed=stream, adapter=adapter, explain=explain)
            except NoWorkerAvailable as exc:
                if not failures:
                    m.requests.labels(policy, label, "", "no_worker").inc()
                    raise no_worker(exc, self.breakers.blocked()) from None
                break
            t0 = time.perf_counter()
            m.decision_seconds.observe(t0 - t_decide)
            d, facts = ticket.decision, ticket.request
            self.breakers.on_dispatch(d.worker)
            content, hdrs = send_raw, headers
            if d.rank is not None:  # a DP worker: pin the rank the ledger booked (serve_app.dp_ranks)
                content, hdrs = pinned_body(send_body_obj, d.rank), pinned_headers(headers)
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
            if ticket.receipt is not None:
                out_headers[ROUTE_HEADER] = receipt_header(ticket.receipt)
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
                if up.status_code == 200 and self.config.prediction_check.enabled:
                    self._check(ticket, body_usage(content, path), label)
                await send_body(send, up.status_code, content, content_type=None, headers=out_headers)
                return
            if up.content_type:
                out_headers.pop("content-type", None)
            await send_stream(send, up.status_code,
                              self._relay(up, ticket, t0, policy, label, path,
                                          UsageStrip() if strip else None),
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
                     model: str = "", path: str = "", strip: UsageStrip | None = None) -> AsyncIterator[bytes]:
        """Pass SSE chunks through as they arrive; a break after the start ends with an error event.
        With `strip`, the usage chunk the router asked for is taken out (and read); else the usage the
        stream carries is read from its last pieces — no other chunk is decoded."""
        worker = ticket.worker
        first = True
        outcome = "cancelled"
        check = up.status_code == 200 and self.config.prediction_check.enabled
        prev = last = b""
        try:
            async for chunk in up.chunks(self.config.stream_batching_interval_ms / 1e3,
                                              hold_reads=self.config.stream_batching_hold_reads):
                if first:
                    ticket.first_token()
                    self.metrics.ttft_seconds.labels(worker).observe(time.perf_counter() - t0)
                    first = False
                if strip is not None:
                    chunk = strip.piece(chunk)
                    if not chunk:
                        continue
                elif check:
                    prev, last = last, chunk
                yield chunk
            if strip is not None:
                rest = strip.flush()
                if rest:
                    yield rest
            outcome = "ok"
            if check:
                self._check(ticket, strip.usage if strip is not None else stream_usage(prev + last, path), model)
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

    def _check(self, ticket: RequestTicket, usage: Usage | None, model: str) -> None:
        """Compare the engine's reported reuse with kvroute's prediction (`RouterCore.check_prediction`)."""
        if usage is None:
            return
        predicted, warning = self.core.check_prediction(ticket, usage.prompt_tokens, usage.cached_tokens)
        m, worker = self.metrics, ticket.worker
        m.prompt_tokens.labels(worker, model).inc(usage.prompt_tokens)
        m.cached_tokens.labels(worker, model).inc(usage.cached_tokens)
        m.predicted_cached_tokens.labels(worker, model).inc(predicted)
        if usage.prompt_tokens:
            m.prediction_error.labels(worker).observe((predicted - usage.cached_tokens) / usage.prompt_tokens)
        if warning is not None:
            logger.warning("%s", warning)

    async def models(self, send: Send, workers: dict[str, Any]) -> None:
        """`GET /v1/models`: every model the fleet serves, from the fleet view (OpenAI's list shape).
        Only a fleet whose workers declare no model asks a healthy worker (tried in random order)."""
        served = self.core.served_models()
        if served:
            # each model, then its loaded LoRA adapters as SGLang lists them (`root`: the adapter's
            # path, `parent`: the model); `workers`: how many workers declare (have loaded) it
            data: list[dict[str, Any]] = []
            for m in served:
                data.append({"id": m, "object": "model", "created": 0, "owned_by": "kvroute", "root": m,
                             "parent": None, "workers": self.core.declaring(m)})
                data += [{"id": a, "object": "model", "created": 0, "owned_by": "kvroute", "root": root,
                          "parent": m, "workers": n} for a, (root, n) in self.core.adapters(m).items()]
            await send_json(send, 200, {"object": "list", "data": data})
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
