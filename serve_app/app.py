"""The router as a Ray Serve deployment: routes and wiring, and the app builder for `serve deploy`.

The deployment answers HTTP as a raw ASGI app (`@serve.ingress()` + `__serve_build_asgi_app__`):
requests reach it through Serve's ingress (HAProxy → the replica's own HTTP server, see
`serve_app.ray_env`). What a route does lives elsewhere: the guards in `serve_app.guards`, the
request path in `serve_app.forward`, fleet changes in `actors.admin`, peer sharing in
`serve_app.sharing`, metrics in `serve_app.metrics`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from typing import Any, Awaitable, Callable

import ray
from ray import serve

from actors import admin
from actors.aggregator.actor import get_or_create_aggregator
from actors.fleet import FleetError, parse_fleet
from actors.models import NAMESPACE, Settings
from serve_app import guards
from serve_app.breaker import Breakers
from serve_app.config import APP_NAME, DEPLOYMENT_NAME, AppArgs, RouterConfig
from serve_app.follower import FleetFollower
from serve_app.forward import POLICY_HEADER, WORKER_HEADER, Forwarder
from serve_app.http import ClientGone, HttpError, Receive, Request, Scope, Send, lifespan, send_body, send_error, send_json
from serve_app.kv_follower import KvFollower
from serve_app.metrics import RouterMetrics
from serve_app.pd import decide_pair
from serve_app.policies import NoWorkerAvailable
from serve_app.proxy import UpstreamClient
from serve_app.router import RouterCore
from serve_app.sharing import share_in_flight

logger = logging.getLogger("kvroute.router")

__all__ = ["KvRouter", "build_app", "DEPLOYMENT_NAME", "APP_NAME", "POLICY_HEADER", "WORKER_HEADER"]

Handler = Callable[[Request, Send], Awaitable[None]]
_PROXIED = ("/v1/chat/completions", "/v1/completions", "/generate")
_ADMIN_WORKER = "/admin/workers/"


@serve.deployment(name=DEPLOYMENT_NAME, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class KvRouter:
    """One router replica. Requests read the local snapshot; nothing on the request path awaits an actor."""

    def __init__(self, args: dict[str, Any]) -> None:
        app_args = AppArgs.model_validate(args)
        self.config: RouterConfig = app_args.router.with_env()
        fleet = app_args.fleet_spec()
        self.settings: Settings = app_args.plane_settings()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            self.replica_id = uuid.uuid4().hex[:8]
        s = self.settings
        self.follower = FleetFollower(self._resolve_aggregator, poll_timeout_s=s.snapshot_poll_timeout_s,
                                      backoff_s=s.reconnect_backoff_s, backoff_max_s=s.reconnect_backoff_max_s,
                                      silence_s=s.follower_silence_s)
        self.core = RouterCore(self.config, self.follower, self.replica_id, kv_follower=lambda index: KvFollower(
            index, self._resolve_actor, poll_timeout_s=s.snapshot_poll_timeout_s))
        self.breakers = Breakers(self.config.breaker)
        self.metrics = RouterMetrics(self.core, self.breakers)
        self.forwarder = Forwarder(self.core, UpstreamClient(self.config.upstream_connect_timeout_s,
                                                             self.config.upstream_read_timeout_s),
                                   self.breakers, self.metrics, self.config)
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/healthz"): self.healthz,
            ("GET", "/metrics"): self.prometheus,
            ("GET", "/workers"): self.workers,
            ("GET", "/v1/models"): self.models,
            ("POST", "/route"): self.route,
            ("POST", "/admin/workers"): self.add_workers,
            **{("POST", p): self._proxy_route(p) for p in _PROXIED},
        }
        if self.config.gc_thresholds is not None:  # (the replica's process is this deployment's alone)
            gc.set_threshold(*self.config.gc_thresholds)
        self.follower.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(share_in_flight(self.core, self.replica_id, self._resolve_aggregator, s))]
        if app_args.manage_fleet and fleet is not None:
            self._tasks.append(loop.create_task(self._ensure_fleet(fleet)))
        logger.info("router replica %s up, policy %s", self.replica_id, self.config.policy)

    def __serve_build_asgi_app__(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        asgi = self._asgi

        async def app(scope: Scope, receive: Receive, send: Send) -> None:  # a function: uvicorn reads it as ASGI 3
            await asgi(scope, receive, send)
        return app

    # --- wiring -------------------------------------------------------------------------------

    async def _ensure_fleet(self, fleet: Any) -> None:
        """`serve deploy` path: nobody else starts the worker actors, so every replica makes sure they exist."""
        for name in await admin.ensure_workers(fleet, self.settings):
            logger.error("worker %s: could not create its actor", name)

    async def _resolve_actor(self, name: str) -> Any:
        return await asyncio.to_thread(ray.get_actor, name, NAMESPACE)

    async def _resolve_aggregator(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await lifespan(receive, send)
            return
        request = Request(scope, receive)
        handler = self._routes.get((request.method, request.path))
        try:
            if handler is not None:
                await handler(request, send)
            elif request.method == "DELETE" and request.path.startswith(_ADMIN_WORKER):
                await self.remove_worker(request, send, request.path[len(_ADMIN_WORKER):])
            elif any(p == request.path for _, p in self._routes) or request.path.startswith(_ADMIN_WORKER):
                raise HttpError(405, f"method {request.method} not allowed on {request.path}", code="method_not_allowed")
            else:
                raise HttpError(404, f"no route {request.path}", code="not_found")
        except HttpError as err:
            await send_error(send, err)
        except ClientGone:
            return

    # --- routes -------------------------------------------------------------------------------

    async def healthz(self, request: Request, send: Send) -> None:
        h = self.core.healthz()
        await send_json(send, 200 if h["status"] != "unavailable" else 503, h)

    async def prometheus(self, request: Request, send: Send) -> None:
        guards.check_client(request, self.config)
        await send_body(send, 200, self.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    async def workers(self, request: Request, send: Send) -> None:
        guards.check_client(request, self.config)
        await send_json(send, 200, self.core.workers_json())

    async def models(self, request: Request, send: Send) -> None:
        guards.check_client(request, self.config)
        await self.forwarder.models(send, self.follower.workers)

    async def route(self, request: Request, send: Send) -> None:
        guards.check_client(request, self.config)
        _, body = await guards.json_body(request, self.config)
        facts, policy, model, adapter = self.forwarder.routing_input(request, body)
        try:
            if self.core.disaggregated(model):  # a prefill + decode pair (docs/pd.md)
                pair = decide_pair(self.core, facts, policy, model)
                rec = self.follower.workers.get(pair.decode.worker)
                await send_json(send, 200, {**pair.as_json(), "model": model,
                                            "models": rec.models if rec is not None else []})
                return
            receipt: dict[str, Any] = {}  # (the route receipt: /route is the decision's own diagnostic)
            d, _ = self.core.decide(facts, policy, model=model, adapter=adapter, receipt=receipt)
        except NoWorkerAvailable as exc:
            raise HttpError(503, str(exc), code="no_worker", headers={"retry-after": "1"}) from None
        rec = self.follower.workers.get(d.worker)
        await send_json(send, 200, {"worker": d.worker, "rank": d.rank, "url": d.url, "policy": d.policy,
                                    "reason": d.reason, "model": model, "adapter": adapter,
                                    "models": rec.models if rec is not None else [],
                                    "candidates": receipt["candidates"]})

    def _proxy_route(self, path: str) -> Handler:
        async def proxy(request: Request, send: Send) -> None:
            guards.check_client(request, self.config)
            raw, body = await guards.json_body(request, self.config)
            await self.forwarder.forward(request, send, path, raw, body)
        return proxy

    async def add_workers(self, request: Request, send: Send) -> None:
        """Add workers at run time: body is a fleet mapping `{"workers": [...]}` or one worker entry."""
        guards.check_admin(request, self.config)
        _, body = await guards.json_body(request, self.config)
        try:
            fleet = parse_fleet(body if "workers" in body else {"workers": [body]}, "request body")
        except FleetError as exc:
            raise HttpError(400, str(exc), code="invalid_fleet") from None
        clash = [w.name for w in fleet.expanded() if w.name in self.follower.workers]
        if clash:
            raise HttpError(409, f"worker(s) already in the fleet: {', '.join(clash)}", code="worker_exists")
        try:
            added = await admin.add_workers(fleet, self.settings)
        except admin.AdminError as exc:
            raise HttpError(400, str(exc), code="worker_failed") from None
        logger.info("fleet: added %s", ", ".join(a["name"] for a in added))
        await send_json(send, 200, {"added": added})

    async def remove_worker(self, request: Request, send: Send, name: str) -> None:
        guards.check_admin(request, self.config)
        if not await admin.remove_worker(name, self.settings):
            raise HttpError(404, f"no worker named {name!r}", code="unknown_worker")
        logger.info("fleet: removed %s", name)
        await send_json(send, 200, {"removed": name})


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
