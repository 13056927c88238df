"""kvroute as a Ray Serve `RequestRouter` for deployments whose replicas run SGLang.

Name it in the deployment's `request_router_config`:
    request_router_class: serve_app.ray_llm.request_router:KvRouteRequestRouter
    request_router_kwargs: {policy: kv_aware}          # optional; any kvroute policy by name
    request_router_kwargs: {tokenizer: sim}            # exact prefix mode (replicas with kv_events: true)

Each handle (e.g. Ray Serve LLM's `OpenAiIngress`) gets one instance. It follows the aggregator's
fleet off the request path (`FleetFollower`, as the router replica does), and ranks candidates with
the same `RouterCore` — the policy over the replicas' KvMetrics, this router's in-flight ledger and
its prefix index. The ingress (kvroute's `ingress.OpenAiIngress`) signals each streamed reply's first
token (`first_token`), which releases that request's prefill charge as in the router replica. The
replica registered by `server.KvrouteSGLangServer` is found by its Serve
replica id (`names.replica_worker_name`). Ray then tries the first rank (probing queue lengths,
skipping full replicas), then the next.

Exact prefix mode (`tokenizer`: `sim` or `hf:<dir>`, kvroute's `router.tokenizer`): prompts are
tokenized like the engine — chat prompts as Ray Serve LLM's SGLangServer makes SGLang tokenize them
(`chat_render.rendered_chat_ids`; `render_chat: false` for replicas that forward the OpenAI body to
SGLang's own HTTP server, which applies the template directly) — and, for every replica whose record names a KV log (`kv_events_actor`:
`server.KvrouteSGLangServer` with `kv_events: true`, or a worker actor), a `KvFollower` long-polls
that log into this router's exact index, off the request path as in kvroute's router replica.
A replica whose log is not followed yet (starting, restarting, its actor unreachable) keeps the
approximate overlap — what this router sent there — and the load terms; once followed, its overlap
is what its engine reports caching. A log outage never errors: the follower retries with backoff.

Crashed replicas leave the fleet through the router: a replica stopped gracefully deregisters itself
(`KvrouteSGLangServer.__del__`), but a crashed one cannot, and the aggregator keeps a worker whose
heartbeats stopped as `down` for good (a fleet file's worker comes back under its name; a Serve replica
never does — its replacement has a new id). So every `sweep_s` the router removes from the aggregator
this deployment's `serve:` workers that are `down` and no longer among Serve's replicas (Serve's own
record of which replicas exist). A replica that is merely slow is still a Serve replica and stays; one
removed by mistake re-registers with its next heartbeat.

Degrades, never fails: a request without a prompt, a fleet with none of the candidates yet, an
aggregator silent for `stale_after_s`, or no routable worker → every candidate in one rank, which
Serve load-balances (power of two choices on queue length). Replicas not yet registered join the
first rank beside kvroute's pick, so a new replica takes load from the start.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.aggregator.actor import get_or_create_aggregator
from actors.models import NAMESPACE, Settings
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower
from serve_app.kv_follower import KvFollower
from serve_app.policies import NoWorkerAvailable
from serve_app.policies.base import RouteRequest
from serve_app.ray_llm import first_token
from serve_app.ray_llm.chat_render import rendered_chat_ids, serve_tokenizer
from serve_app.ray_llm.names import ROUTING_STATS_KEY, replica_worker_name, worker_name
from serve_app.ray_llm.ranking import request_body, reason_label, split_ranks
from serve_app.request_facts import InvalidRequestBody, facts_from_body
from serve_app.router import RouterCore

logger = logging.getLogger("kvroute.ray_llm.router")

_FACTS_CAP = 100_000  # facts of requests chosen for but never routed (cancelled) are dropped past this


class KvRouteRequestRouter(RequestRouter):
    """Serve request router ranking replicas with kvroute's `RouterCore` (see the module docstring)."""

    def initialize_state(
        self,
        policy: str = "kv_aware",
        router: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        stale_after_s: float = 5.0,
        ray_metrics: bool = True,
        tokenizer: str | None = None,
        render_chat: bool = True,
        sweep_s: float = 2.0,
    ) -> None:
        """`request_router_kwargs`: `policy` (any kvroute policy name), `router` (RouterConfig fields,
        e.g. `{"kv_aware": {"tolerance": 0.2}}`), `settings` (metrics-plane Settings), how long the
        aggregator may be silent before routing falls back to load balancing, whether to export
        kvroute's figures through `ray.util.metrics`, `tokenizer` (RouterConfig's: `sim` or
        `hf:<dir>` turns on exact prefix mode; `router.block_size` must be the engines' page size) and
        `render_chat` (exact mode: chat prompts reach SGLang as Ray's SGLangServer renders them; false
        when the replicas forward OpenAI bodies to SGLang's HTTP server), and how often crashed replicas
        are removed from the fleet (`sweep_s`; 0: never). Raises ValueError on a bad value."""
        self.config = RouterConfig.model_validate({**(router or {}), "policy": policy,
                                                   **({"tokenizer": tokenizer} if tokenizer is not None else {})})
        self.settings = Settings.model_validate(settings or {})
        self._chat_tokenizer = serve_tokenizer(self.config.tokenizer) if render_chat else None
        self.stale_after_s = float(stale_after_s)
        self.sweep_s = float(sweep_s)
        self.swept = 0  # crashed replicas this router removed from the fleet
        self._sweeper: asyncio.Task | None = None
        self.router_id = f"serve-router-{uuid.uuid4().hex[:8]}"
        self.follower = FleetFollower(
            self._resolve_aggregator,
            poll_timeout_s=self.settings.snapshot_poll_timeout_s,
            backoff_s=self.settings.reconnect_backoff_s,
            backoff_max_s=self.settings.reconnect_backoff_max_s,
            silence_s=self.settings.follower_silence_s,
        )
        s = self.settings
        self.core = RouterCore(self.config, self.follower, self.router_id, kv_follower=lambda index: KvFollower(
            index, self._resolve_actor, poll_timeout_s=s.snapshot_poll_timeout_s, backoff_s=s.reconnect_backoff_s,
            backoff_max_s=s.reconnect_backoff_max_s))
        # internal request id → (facts with overlap, worker charged in the ledger), until routed
        self._charged: dict[str, tuple[RouteRequest, str]] = {}
        self._routed: dict[str, str] = {}  # internal request id → worker, until completed
        self._deployment = self._deployment_id.name if self._deployment_id else ""
        self.exporter = None
        if ray_metrics:
            from serve_app.ray_llm.ray_metrics import RouterExporter

            self.exporter = RouterExporter(self.core, self._deployment)
        self._names: dict[Any, str] = {}  # replica id → worker name, as last seen among the candidates
        self._loop: asyncio.AbstractEventLoop | None = None  # the router's loop (Serve may run it in its own thread)
        self.first_tokens = 0  # first-token signals from the ingress applied to the ledger
        first_token.subscribe(self)
        self._started = False
        self.decisions: dict[str, int] = {}  # reason → count (tests and the bench read these)

    async def _resolve_aggregator(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    async def _resolve_actor(self, name: str) -> Any:
        import ray

        return await asyncio.to_thread(ray.get_actor, name, NAMESPACE)

    def _ensure_started(self) -> None:
        """Start following the fleet on the router's own loop (not running yet at construction)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if not self._started:
            self._started = True
            self.follower.start()
            if self.exporter is not None:
                self.exporter.start()
            if self.sweep_s > 0:
                self._sweeper = self._loop.create_task(self._sweep_loop())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        try:
            self._ensure_started()
        except RuntimeError:  # no running loop here: the first choose_replicas starts it
            pass

    # --- crashed replicas out of the fleet -------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            if not self.curr_replicas:  # Serve has not told this router its replicas yet
                continue
            try:
                await self.sweep({replica_worker_name(rid) for rid in self.curr_replicas})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the aggregator is away: the next sweep tries again
                logger.debug("sweep of crashed replicas failed: %s", exc)

    async def sweep(self, serve_replicas: set[str]) -> list[str]:
        """Remove from the aggregator this deployment's `serve:` workers that are `down` and not among
        `serve_replicas` (the worker names of Serve's current replicas). Returns the names removed."""
        d = self._deployment_id
        if d is None:
            return []
        prefix = worker_name(d.app_name or "", d.name, "")
        gone = [n for n, rec in self.follower.workers.items()
                if n.startswith(prefix) and rec.state == "down" and n not in serve_replicas]
        if not gone:
            return []
        aggregator = await self._resolve_aggregator()
        removed = []
        for name in gone:
            if await aggregator.remove.remote(name):
                removed.append(name)
                logger.info("worker %s: its Serve replica is gone and it is down: removed from the fleet", name)
        self.swept += len(removed)
        return removed

    # --- the decision ---------------------------------------------------------------------------

    def _name_of(self, replica: RunningReplica) -> str:
        """The replica's kvroute worker: the name it reports in its routing stats (a replica in front
        of a worker kvroute already knows), else the one `KvrouteSGLangServer` registers it under."""
        stats = replica.routing_stats or {}
        name = stats.get(ROUTING_STATS_KEY)
        if not isinstance(name, str) or not name:
            name = replica_worker_name(replica.replica_id)
        self._names[replica.replica_id] = name
        return name

    def _facts(self, body: dict[str, Any]) -> RouteRequest:
        """Routing facts; in exact mode a chat's token ids are those Ray's SGLangServer makes SGLang compute."""
        if self._chat_tokenizer is not None and "messages" in body:
            ids = rendered_chat_ids(self._chat_tokenizer, body)
            if ids is not None:
                return facts_from_body(body, config=self.core.facts_config, token_ids=ids)
            self.core.tokenize_failures += 1  # the template refused it: approximate for this one
        return self.core.facts(body)

    def _degraded(self) -> bool:
        age = self.follower.snapshot_age_s()
        return age is None or (not self.follower.connected and age > self.stale_after_s)

    def _count(self, reason: str, policy: str, t0: float) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        if self.exporter is not None:
            self.exporter.on_decision(policy, reason, time.perf_counter() - t0)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        self._ensure_started()
        policy = self.config.policy
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        rid = pending_request.metadata.internal_request_id
        charged = self._charged.get(rid)
        facts = charged[0] if charged is not None else None
        if facts is None:
            body = request_body(pending_request.args)
            if body is None:
                self._count("no_prompt", policy, t0)
                return [candidate_replicas]
            try:
                facts = self._facts(body)
            except (InvalidRequestBody, RecursionError) as exc:  # the replica will answer it; route anywhere
                logger.debug("request %s: no routing facts (%s)", rid, exc)
                self._count("no_prompt", policy, t0)
                return [candidate_replicas]
        if self._degraded():
            self._count("aggregator_stale", policy, t0)
            return [candidate_replicas]
        by_name = {self._name_of(r): r for r in candidate_replicas}
        known = self.follower.workers
        if not any(n in known for n in by_name):
            self._count("no_metrics", policy, t0)
            return [candidate_replicas]
        exclude = {n for n in known if n not in by_name}
        if rid in self._charged:  # chosen before (Serve retries after a rejection or backoff): undo
            self.core.ledger.on_failed(rid)
            del self._charged[rid]
        try:
            decision, facts = self.core.decide(facts, policy, exclude=exclude)
        except NoWorkerAvailable:
            self._count("no_worker", policy, t0)
            return [candidate_replicas]
        if len(self._charged) >= _FACTS_CAP:  # choices Serve never followed up: release, then forget
            for stale in self._charged:
                self.core.ledger.on_failed(stale)
            self._charged.clear()
        # charged now, not when Serve reports the request routed (after the replica accepted it):
        # in a burst every routing task would otherwise decide on the same empty ledger
        self.core.on_routed(rid, facts, decision.worker)
        self._charged[rid] = (facts, decision.worker)
        future = getattr(pending_request, "future", None)
        if future is not None:
            future.add_done_callback(lambda f, rid=rid: self._choice_settled(rid, f))
        self._count(reason_label(facts, decision.worker), policy, t0)
        return split_ranks(by_name, decision.worker, set(known))

    # --- the request's moments ------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = pending_request.metadata.internal_request_id
        charged = self._charged.pop(rid, None)
        if charged is None:  # load-balanced without kvroute's facts: nothing to count
            return
        facts, decided = charged
        worker = self._names.get(replica_id) or replica_worker_name(replica_id)
        if worker != decided:  # Serve took another rank (the pick was full): move the charge
            self.core.ledger.on_failed(rid)
            self.core.on_routed(rid, facts, worker)
        if len(self._routed) >= _FACTS_CAP:
            self._routed.clear()
        self._routed[rid] = worker

    def on_first_token_signal(self, internal_request_id: str) -> None:
        """`first_token.first_token` from the ingress (any thread): release the prefill charge on our loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._first_token, internal_request_id)

    def _first_token(self, rid: str) -> None:
        if rid in self._routed or rid in self._charged:  # one of ours (another deployment's router ignores it)
            self.core.ledger.on_first_token(rid)
            self.first_tokens += 1
            if self.exporter is not None:
                self.exporter.on_first_token()

    def _choice_settled(self, rid: str, future: Any) -> None:
        """The request's routing future is done. Cancelled (the caller gave up while Serve was still
        routing it) or failed: Serve sends it nowhere and reports nothing more, so the charge made
        when it was chosen is released here. Fulfilled: `on_request_routed` follows (or, on paths
        without the replica's accept, `on_request_completed`)."""
        if (future.cancelled() or future.exception() is not None) and self._charged.pop(rid, None) is not None:
            self.core.ledger.on_failed(rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Ray calls this for every dispatched request (success, error or cancel), a dead replica's too.
        # A request it dispatched without reporting it routed is still in `_charged`: Serve's sends
        # without the replica's accept (Ray Client; the handle's `choose_replica`/`dispatch` API, which
        # Ray Serve LLM's prefill/decode pattern uses) never call `on_request_routed`, and a send that
        # raised before its completion callback was registered reports only this.
        if (self._routed.pop(internal_request_id, None) is not None
                or self._charged.pop(internal_request_id, None) is not None):
            self.core.ledger.on_finished(internal_request_id)
