"""The router as a Ray Serve deployment with a FastAPI ingress, and the app builder for `serve deploy`."""


import asyncio
import hmac
import json
import logging
import random
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import ray
from ray import serve

from actors.aggregator import get_or_create_aggregator
from actors.fleet import FleetError, parse_fleet
from actors.link import AggregatorLink
from actors.worker_actor import kill_worker_actors, start_worker_actor
from actors.models import Settings
from serve_app.breaker import BreakerConfig, Breakers
from serve_app.config import AppArgs, RouterConfig
from serve_app.metrics import RouterMetrics
from serve_app.follower import FleetFollower
from serve_app.kv_follower import KvFollower
from serve_app.policies import NoWorkerAvailable, UnknownPolicy
from serve_app.proxy import UPSTREAM_ERRORS, Upstream, UpstreamClient, UpstreamError, forward_headers, sse_error_event
from serve_app.request_facts import InvalidRequestBody
from serve_app.router import RouterCore

logger = logging.getLogger("kvroute.router")

POLICY_HEADER = "x-kvroute-policy"
WORKER_HEADER = "x-kvroute-worker"
DEPLOYMENT_NAME = "KvRouter"
APP_NAME = "kvroute"

fastapi_app = FastAPI(title="kvroute", description="KV-cache-aware router for SGLang workers")


def _error(status: int, message: str, *, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI-shaped error body."""
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error", "code": code}},
        status_code=status,
        headers=headers,
    )


def _bearer_ok(request: Request, key: str) -> bool:
    """OpenAI-style `Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class _BodyTooLarge(Exception):
    pass


@serve.deployment(name=DEPLOYMENT_NAME, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(fastapi_app)
class KvRouter:
    """One router replica. Requests read the local snapshot; nothing on the request path awaits an actor."""

    def __init__(self, args: dict[str, Any]) -> None:
        app_args = AppArgs.model_validate(args)
        self.config: RouterConfig = app_args.router.with_env()
        fleet = app_args.fleet_spec()
        self.settings: Settings = fleet.settings if fleet else Settings()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            self.replica_id = uuid.uuid4().hex[:8]
        self.follower = FleetFollower(
            self._resolve_aggregator,
            poll_timeout_s=self.settings.snapshot_poll_timeout_s,
            backoff_s=self.settings.reconnect_backoff_s,
            backoff_max_s=self.settings.reconnect_backoff_max_s,
            silence_s=self.settings.follower_silence_s,
        )
        self.core = RouterCore(self.config, self.follower, self.replica_id)
        self.upstream = UpstreamClient(self.config.upstream_connect_timeout_s, self.config.upstream_read_timeout_s)
        self.breakers = Breakers(BreakerConfig(self.config.breaker_failures, self.config.breaker_open_s))
        self.metrics = RouterMetrics(self.core, self.breakers)
        self.core.kv_follower = KvFollower(self.core.exact, self._resolve_actor,
                                           poll_timeout_s=self.settings.snapshot_poll_timeout_s)
        self.follower.start()
        self._fleet = fleet if app_args.manage_fleet else None
        self._ensure_task = asyncio.get_running_loop().create_task(self._ensure_fleet())
        self._share_task = asyncio.get_running_loop().create_task(self._share_in_flight())
        logger.info("router replica %s up, policy %s", self.replica_id, self.config.policy)

    async def _ensure_fleet(self) -> None:
        """`serve deploy` path: nobody else starts the worker actors, so every replica makes sure
        they exist (named, detached, get-if-exists: idempotent across replicas and restarts)."""
        if self._fleet is None:
            return
        for spec in self._fleet.expanded():
            try:
                await asyncio.to_thread(start_worker_actor, spec, self.settings, detached=True, get_if_exists=True)
            except Exception:
                logger.exception("worker %s: could not create its actor", spec.name)

    async def _resolve_actor(self, name: str) -> Any:
        return await asyncio.to_thread(ray.get_actor, name, "kvroute")

    async def _resolve_aggregator(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    async def _share_in_flight(self) -> None:
        """Batched, like the metrics: this replica's in-flight counts reach the other replicas
        (pushed over the aggregator's ZeroMQ ingest, as worker reports are; no Ray call per share)."""
        last: dict[str, int] | None = None
        last_sent = 0.0
        link = AggregatorLink(self._resolve_aggregator, hwm=2, backoff_s=self.settings.reconnect_backoff_s,
                              backoff_max_s=self.settings.reconnect_backoff_max_s)
        while True:
            try:
                await asyncio.sleep(self.settings.push_interval_s * 5)
                self.core.refresh_remote()
                counts = self.core.ledger.export()
                now = time.monotonic()
                if counts != last or now - last_sent > self.settings.heartbeat_s:
                    if await link.ensure() and link.push_in_flight(self.replica_id, counts):
                        last, last_sent = counts, now
            except asyncio.CancelledError:
                link.close()
                raise
            except Exception as exc:  # aggregator away: counts are resent when it is back
                logger.debug("in-flight share failed: %s", exc)
                await asyncio.sleep(self.settings.reconnect_backoff_max_s)

    # --- guards -------------------------------------------------------------------------------

    def _auth(self, request: Request) -> JSONResponse | None:
        """Guards every route but /healthz: header size bound, then the API key."""
        size = sum(len(k) + len(v) for k, v in request.headers.raw)
        if size > self.config.max_header_bytes:
            return _error(431, f"request headers total {size} bytes, above the limit of {self.config.max_header_bytes}",
                          code="headers_too_large")
        key = self.config.api_key
        if key and not _bearer_ok(request, key):
            return _error(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise _BodyTooLarge()
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    async def _json_body(self, request: Request) -> tuple[bytes, dict[str, Any]] | JSONResponse:
        try:
            raw = await self._read_body(request)
        except _BodyTooLarge:
            return _error(413, f"request body larger than {self.config.max_body_bytes} bytes", code="body_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"body is not valid JSON: {exc}", code="invalid_json")
        except RecursionError:
            return _error(400, "body JSON is nested too deeply", code="invalid_json")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object", code="invalid_body")
        return raw, body

    # --- routes -------------------------------------------------------------------------------

    @fastapi_app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        h = self.core.healthz()
        return JSONResponse(h, status_code=200 if h["status"] != "unavailable" else 503)

    def _admin(self, request: Request) -> JSONResponse | None:
        key = self.config.admin_key
        if not key:
            return _error(403, "fleet changes are disabled: set router admin_key (env KVROUTE_ADMIN_KEY)",
                          code="admin_disabled")
        if not _bearer_ok(request, key):
            return _error(401, "missing or invalid admin key (Authorization: Bearer <admin key>)", code="invalid_admin_key")
        return None

    @fastapi_app.post("/admin/workers")
    async def add_workers(self, request: Request) -> JSONResponse:
        """Add workers at run time: body is a fleet mapping `{"workers": [...]}` or one worker entry."""
        if (denied := self._admin(request)) is not None:
            return denied
        parsed = await self._json_body(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        _, body = parsed
        try:
            fleet = parse_fleet(body if "workers" in body else {"workers": [body]}, "request body")
        except FleetError as exc:
            return _error(400, str(exc), code="invalid_fleet")
        clash = [w.name for w in fleet.expanded() if w.name in self.follower.workers]
        if clash:
            return _error(409, f"worker(s) already in the fleet: {', '.join(clash)}", code="worker_exists")
        added = []
        for spec in fleet.expanded():
            try:
                actor = await asyncio.to_thread(start_worker_actor, spec, self.settings, detached=True)
                info = await asyncio.wait_for(actor.ready.remote(), timeout=300)
            except Exception as exc:
                await asyncio.to_thread(kill_worker_actors, names=[spec.name])
                return _error(400, f"worker {spec.name}: {str(exc).strip().splitlines()[-1][:300]}",
                              code="worker_failed", headers=None)
            added.append({"name": spec.name, "url": info.url, "metrics_endpoint": info.metrics_endpoint})
        logger.info("fleet: added %s", ", ".join(a["name"] for a in added))
        return JSONResponse({"added": added})

    @fastapi_app.delete("/admin/workers/{name}")
    async def remove_worker(self, name: str, request: Request) -> JSONResponse:
        if (denied := self._admin(request)) is not None:
            return denied
        killed = await asyncio.to_thread(kill_worker_actors, names=[name])
        agg = await self._resolve_aggregator()
        removed = await agg.remove.remote(name)
        if not killed and not removed:
            return _error(404, f"no worker named {name!r}", code="unknown_worker")
        logger.info("fleet: removed %s", name)
        return JSONResponse({"removed": name})

    @fastapi_app.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        if (denied := self._auth(request)) is not None:
            return denied
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @fastapi_app.get("/workers")
    async def workers(self, request: Request) -> JSONResponse:
        if (denied := self._auth(request)) is not None:
            return denied
        return JSONResponse(self.core.workers_json())

    @fastapi_app.post("/route")
    async def route(self, request: Request) -> JSONResponse:
        parsed = await self._routing_input(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        _, _, facts, policy = parsed
        try:
            d, _ = self.core.decide(facts, policy)
        except NoWorkerAvailable as exc:
            return _error(503, str(exc), code="no_worker", headers={"retry-after": "1"})
        return JSONResponse({"worker": d.worker, "url": d.url, "policy": d.policy, "reason": d.reason})

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/chat/completions")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/completions")

    @fastapi_app.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._proxy(request, "/generate")

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self._auth(request)) is not None:
            return denied
        healthy = [r for r in self.follower.workers.values() if r.state != "down" and r.healthy]
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
            return Response(content, status_code=up.status_code, media_type="application/json",
                            headers={WORKER_HEADER: rec.name})
        return _error(503, "no healthy worker to answer /v1/models", code="no_worker", headers={"retry-after": "1"})

    # --- proxy --------------------------------------------------------------------------------

    async def _routing_input(self, request: Request) -> tuple[bytes, dict[str, Any], Any, str] | JSONResponse:
        """Guards, body, routing facts and policy name of a request to route, or its 4xx."""
        if (denied := self._auth(request)) is not None:
            return denied
        parsed = await self._json_body(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        raw, body = parsed
        try:
            facts = self.core.facts(body)
            policy = self.core.policy(request.headers.get(POLICY_HEADER)).name
        except InvalidRequestBody as exc:
            return _error(400, str(exc), code="invalid_body")
        except RecursionError:
            return _error(400, "body is nested too deeply", code="invalid_body")
        except UnknownPolicy as exc:
            return _error(400, str(exc), code="unknown_policy")
        return raw, body, facts, policy

    async def _proxy(self, request: Request, path: str) -> Response:
        parsed = await self._routing_input(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        raw, body, facts, policy = parsed
        stream = body.get("stream") is True
        headers = forward_headers(request.headers)
        tried: set[str] = set()
        failures: list[str] = []
        retry_after: str | None = None
        m = self.metrics
        for attempt in range(self.config.max_attempts):
            t_decide = time.perf_counter()
            try:
                d, facts = self.core.decide(facts, policy, exclude=tried | self.breakers.blocked())
            except NoWorkerAvailable as exc:
                if not failures:
                    m.requests.labels(policy, "", "no_worker").inc()
                    return _error(503, f"{exc}; open breakers: {sorted(self.breakers.blocked()) or 'none'}",
                                  code="no_worker", headers={"retry-after": "1"})
                break
            m.decision_seconds.observe(time.perf_counter() - t_decide)
            rid = uuid.uuid4().hex
            self.core.on_routed(rid, facts, d.worker)
            self.breakers.on_dispatch(d.worker)
            t0 = time.perf_counter()
            try:
                up = await self.upstream.open(d.worker, "POST", d.url + path, content=raw, headers=headers)
            except UpstreamError as exc:
                self._failed(rid, d.worker, exc.counts_for_breaker)
                tried.add(d.worker)
                failures.append(str(exc))
                retry_after = exc.retry_after or retry_after
                m.retries.labels(d.worker).inc()
                logger.info("attempt %d on %s failed before first byte: %s", attempt + 1, d.worker, exc)
                await asyncio.sleep(min(0.5, 0.02 * (2**attempt)) * random.uniform(0.5, 1.5))
                continue
            except asyncio.CancelledError:  # client went away before the worker answered
                self.core.ledger.on_failed(rid)
                raise
            out_headers = {**up.headers(), WORKER_HEADER: d.worker}
            if not stream:
                try:
                    content = await up.read()
                except UPSTREAM_ERRORS as exc:  # died mid-body: nothing sent yet, so retry elsewhere
                    self._failed(rid, d.worker, True)
                    tried.add(d.worker)
                    m.retries.labels(d.worker).inc()
                    failures.append(f"worker {d.worker}: {type(exc).__name__} while reading the body")
                    continue
                finally:
                    await up.close()
                self._finished(rid, d, t0, up.status_code, policy)
                logger.debug("routed %s to %s (%s) in %.1f ms", path, d.worker, d.reason, (time.perf_counter() - t0) * 1e3)
                return Response(content, status_code=up.status_code, headers=out_headers)
            return StreamingResponse(
                self._relay(up, rid, d, t0, policy),
                status_code=up.status_code,
                headers=out_headers,
                media_type=up.content_type or "text/event-stream",
            )
        m.requests.labels(policy, "", "unavailable").inc()
        return _error(
            503,
            f"no worker could serve the request after {len(failures)} attempt(s): " + "; ".join(failures[-3:]),
            code="upstream_unavailable",
            headers={"retry-after": retry_after or "1"},
        )

    def _failed(self, rid: str, worker: str, counts_for_breaker: bool) -> None:
        self.core.ledger.on_failed(rid)
        if counts_for_breaker and self.breakers.on_failure(worker):
            self.metrics.breaker_opened.labels(worker).inc()
            logger.warning("worker %s: circuit breaker opened", worker)

    def _finished(self, rid: str, d: Any, t0: float, status: int, policy: str) -> None:
        self.core.ledger.on_finished(rid)
        self.breakers.on_success(d.worker)
        elapsed = time.perf_counter() - t0
        self.metrics.duration_seconds.labels(d.worker).observe(elapsed)
        self.metrics.requests.labels(policy, d.worker, "ok" if status < 400 else f"http_{status}").inc()

    async def _relay(self, up: Upstream, rid: str, d: Any, t0: float, policy: str) -> AsyncIterator[bytes]:
        """Pass SSE chunks through as they arrive; a break after the start ends with an error event."""
        ledger = self.core.ledger
        first = True
        outcome = "cancelled"
        try:
            async for chunk in up.chunks(self.config.stream_batching_interval_ms / 1e3):
                if first:
                    ledger.on_first_token(rid)
                    self.metrics.ttft_seconds.labels(d.worker).observe(time.perf_counter() - t0)
                    first = False
                yield chunk
            outcome = "ok"
        except UPSTREAM_ERRORS as exc:
            outcome = "broken"
            logger.warning("stream from %s broke after it started: %s", up.worker, type(exc).__name__)
            yield sse_error_event(f"worker {up.worker} failed mid-stream ({type(exc).__name__})")
        finally:
            await up.close()
            if outcome == "ok":
                self._finished(rid, d, t0, up.status_code, policy)
            else:
                self._failed(rid, d.worker, outcome == "broken")
                self.metrics.requests.labels(policy, d.worker, outcome).inc()


def build_app(args: dict[str, Any]) -> Any:
    """App builder for `serve run` / `serve deploy` (`import_path: serve_app.app:build_app`)."""
    app_args = AppArgs.model_validate(args)
    cfg = app_args.router
    opts: dict[str, Any] = {"max_ongoing_requests": cfg.max_ongoing_requests}
    if app_args.replica_resources:
        opts["ray_actor_options"] = {"num_cpus": 0, "resources": dict(app_args.replica_resources)}
    if cfg.num_replicas == "auto":
        opts["num_replicas"] = "auto"
    else:
        opts["num_replicas"] = int(cfg.num_replicas)
    return KvRouter.options(**opts).bind(app_args.model_dump(mode="json"))
