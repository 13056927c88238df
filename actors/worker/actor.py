"""One async Ray actor per SGLang worker: binds the scheduler's metrics PULL, probes liveness,
and pushes coalesced reports to the aggregator without ever blocking its receive loop."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import ray
import zmq
import zmq.asyncio
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.aggregator.actor import get_or_create_aggregator
from actors.worker.endpoint import EndpointError, _ipc_path, bind_pull, default_endpoint  # noqa: F401  (callers import them here)
from actors.fleet import WorkerSpec
from actors.worker.health import HealthProbe, probe_client
from actors.worker.ingest import MetricsBook
from actors.wire.kv_handshake import shows_prefill
from actors.worker.kv_log import KvLog
from actors.worker.kv_subscriber import KvSubscriber, subscribe_for
from actors.worker.launcher import ManagedProcess
from actors.transport.link import AggregatorLink
from actors.worker.metrics_pipe import MetricsPipe
from actors.models import NAMESPACE, Settings
from actors.protocol import (
    KvEventsStatus,
    KvLogAnswer,
    WorkerActorStats,
    WorkerReady,
    WorkerReport,
)

logger = logging.getLogger("kvroute.worker")

@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class WorkerActor:
    """Metrics, liveness and (managed mode) the process of one SGLang worker."""

    def __init__(self, spec: dict[str, Any], settings: dict[str, Any] | None = None) -> None:
        self.spec = WorkerSpec.model_validate(spec)
        self.settings = Settings.model_validate(settings or {})
        self.name = self.spec.name
        self.incarnation = uuid.uuid4().hex[:12]
        self.book = MetricsBook(self.settings.max_frame_bytes)
        self.url = self.spec.url
        self.endpoint = self.spec.metrics_endpoint or default_endpoint(self.name)
        self._stopping = False
        self._wake = asyncio.Event()  # a push now (liveness or status changed): the pipe's push loop sends it
        self._ctx = zmq.asyncio.Context()
        # reports go to the aggregator over ZeroMQ (Ray only finds it): no Ray call per push
        self._link = AggregatorLink(self._resolve_aggregator, ctx=self._ctx, hwm=self.settings.max_pending_pushes,
                                    backoff_s=self.settings.reconnect_backoff_s,
                                    backoff_max_s=self.settings.reconnect_backoff_max_s)
        self._sock = bind_pull(self._ctx, self.name, self.endpoint, self.settings.max_frame_bytes)
        # receive, coalesce and push: the same pipeline as a Serve LLM replica's collector
        self._pipe = MetricsPipe(self.name, self._sock, self.book, self._link, self.settings, self._report,
                                 wake=self._wake)
        self.kv: KvSubscriber | None = None
        self._own_name: str | None = None
        if self.spec.kv_events_endpoint:
            self._open_kv_subscription()  # before the engine starts: managed engines connect to us
        # one pooled client: SGLang's server keeps the connection alive, so a probe is one request
        self._http = probe_client(self.settings)
        # the model names it serves: as the fleet entry says, else (attach mode) its /v1/models once healthy
        self._health = HealthProbe(self.name, self.settings, self._http, self._wake.set,
                                   models=self.spec.declared_models, discover=not self.spec.managed)
        loop = asyncio.get_running_loop()
        self.proc: ManagedProcess | None = None
        self._launch: asyncio.Task | None = None
        if self.spec.managed:
            port = int(self.spec.url.rsplit(":", 1)[1]) if self.spec.url else None
            self.proc = ManagedProcess(self.spec, metrics_endpoint=self.endpoint, port=port,
                                       host=listen_host(self.spec.host),
                                       health_timeout_s=self.settings.engine_start_timeout_s,
                                       on_change=self._on_process_change)
            self.url = self.proc.url
            self._launch = loop.create_task(self.proc.launch())
        self._tasks = [*self._pipe.start(), loop.create_task(self._health_loop())]
        if self.kv is not None:
            self._tasks.append(self.kv.start())
        logger.info("worker %s: PULL bound on %s, probing %s/health", self.name, self.endpoint, self.url)

    def _open_kv_subscription(self) -> None:
        """Before the engine starts: a managed engine connects to what we bound."""
        self.kv, self.spec = subscribe_for(self.spec, self._ctx, self.settings, listen_host=listen_host(self.spec.host),
                                           on_change=self._wake.set)

    @property
    def kv_log(self) -> KvLog | None:
        return None if self.kv is None else self.kv.log

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    @property
    def health_detail(self) -> str:
        return self._health.detail

    @property
    def models(self) -> list[str]:
        return self._health.models

    def _kv_info(self) -> KvEventsStatus:
        """What /workers shows about the KV-event subscription (slow-changing fields only)."""
        assert self.kv is not None
        return self.kv.info()

    def _watch_kv(self) -> None:
        if self.kv is None:
            return
        busy = any(shows_prefill(m.kv_active_blocks, self.spec.page_size, at, self.kv.opened_at)
                   for m, at in self.book.latest_with_times().values())
        self.kv.watch(busy)

    # --- public methods -----------------------------------------------------------------------

    async def ready(self) -> WorkerReady:
        """Where the worker is; in managed mode only once its engine answers /health.
        Raises LaunchError if the engine cannot be started or never becomes healthy."""
        if self._launch is not None:
            await asyncio.shield(self._launch)
        return WorkerReady(name=self.name, url=self.url or "", metrics_endpoint=self.endpoint, node_id=_node_id(),
                           managed=self.proc.status.report() if self.proc else None)

    async def stats(self) -> WorkerActorStats:
        b = self.book.stats
        return WorkerActorStats(
            name=self.name, frames_received=b.frames_received, frames_accepted=b.frames_accepted,
            frames_refused=sum(b.refused.values()), refused_by_reason=dict(b.refused),
            pushes=self._link.sent, pushes_dropped=self._link.dropped, aggregator_connects=self._link.reconnects,
            healthy=self.healthy, health_detail=self.health_detail, aggregator_epoch=self._link.epoch,
            last_refusal=self.book.last_error,
            latest={r: m.model_dump() for r, m in self.book.latest().items()},
            kv_events=None if self.kv is None else self.kv.counters(),
        )

    @ray.method(enable_task_events=False)  # a long poll per router replica: no task-event bookkeeping
    async def kv_since(self, epoch: str | None, seq: int, timeout_s: float = 5.0,
                       worker: str | None = None) -> KvLogAnswer | None:
        """Long poll for router replicas: KV events after their cursor (or the whole state when the
        cursor is from another epoch or too old). None if this worker publishes no KV events."""
        if self.kv is None:
            return None
        return await self.kv.since(epoch, seq, timeout_s)

    async def stop(self, deregister: bool = True) -> None:
        """Close the socket (linger 0), stop the loops, optionally leave the registry. ≤ 1 s."""
        if self._stopping:
            return
        self._stopping = True
        self._pipe.stop()  # no push after this
        for t in self._tasks:
            t.cancel()
        if self.kv is not None:
            await self.kv.close()
        # bounded: on Python 3.11 a wait_for racing the cancel can swallow it and keep a loop alive
        await asyncio.wait({*self._tasks}, timeout=0.5)
        if self.proc is not None:
            await self.proc.stop()
        self._sock.close(linger=0)
        path = _ipc_path(self.endpoint or "")
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
        if deregister and self._link.handle is not None:
            try:
                await asyncio.wait_for(self._link.handle.remove.remote(self.name), timeout=0.5)
            except Exception:  # best effort: the aggregator may be gone already
                pass
        self._link.close()
        self._health.close()
        await self._http.aclose()
        self._ctx.term()
        logger.info("worker %s: stopped", self.name)

    # --- push ---------------------------------------------------------------------------------

    def _report(self) -> WorkerReport:
        page = self.spec.page_size
        ranks = self.book.rank_metrics(page)
        kv = self.kv_log is not None  # routers follow this actor's KV log (exact prefix mode)
        return WorkerReport(name=self.name, url=self.url or "", page_size=page, incarnation=self.incarnation,
                            healthy=self.healthy, health_detail=self.health_detail, ranks=ranks,
                            managed=self.proc.status.report() if self.proc else None,
                            kv_events_actor=self._actor_name() if kv else None,
                            kv_events=self._kv_info() if kv else None, models=self.models,
                            role=self.spec.role, bootstrap_port=self.spec.bootstrap_port, dp_size=self.spec.dp_size,
                            adapters=self._health.adapters)

    def _actor_name(self) -> str:
        if self._own_name is None:
            self._own_name = ray.get_runtime_context().get_actor_name()
        return self._own_name

    async def _resolve_aggregator(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    # --- liveness -----------------------------------------------------------------------------

    def _on_process_change(self) -> None:
        # a dead engine is down now, not at the next probe
        if self.proc is not None and not self.proc.alive:
            self._set_health(False, f"engine process {self.proc.status.state}: {self.proc.status.detail}")
        self._wake.set()

    def _set_health(self, healthy: bool, detail: str) -> None:
        self._health.set(healthy, detail)

    async def _probe(self) -> None:
        if self.proc is not None and not self.proc.alive:
            self._set_health(False, f"engine process {self.proc.status.state}")
            return
        await self._health.probe(self.url)

    async def _health_loop(self) -> None:
        """/health when due (`HealthProbe.due`: passive while the engine's frames arrive), and the KV
        watch at least every `health_interval_s`."""
        interval = self.settings.health_interval_s
        while True:
            try:
                if self._health.due(self.book.heard_at()) <= time.monotonic():
                    await self._probe()
                self._watch_kv()  # and, while the engine shows prefills but no batch came, a replay
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker %s: health probe error", self.name)
            wait = self._health.due(self.book.heard_at()) - time.monotonic()
            await asyncio.sleep(min(max(0.0, wait), interval))


def listen_host(host: str) -> str:
    """Where a managed engine listens: loopback on a one-node Ray (nothing else can reach it),
    the node's IP on a cluster (the router on the head must reach it)."""
    if host != "auto":
        return host
    try:
        if len([n for n in ray.nodes() if n.get("Alive")]) > 1:
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def _node_id() -> str | None:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


WORKER_ACTOR_PREFIX = "kvroute-worker-"


def start_worker(
    spec: WorkerSpec, settings: Settings, *, name_prefix: str = WORKER_ACTOR_PREFIX,
    detached: bool = False, get_if_exists: bool = False,
) -> Any:
    """Create the worker's actor (pinned to `spec.node_id` when known: ipc:// is node-local).
    `detached` + `get_if_exists`: idempotent from any router replica, outlives its creator."""
    opts: dict[str, Any] = {
        "name": f"{name_prefix}{spec.name}",
        "namespace": NAMESPACE,
        "get_if_exists": get_if_exists,
        "num_gpus": spec.num_gpus,
        "num_cpus": spec.num_cpus,
        "resources": dict(spec.resources),
    }
    if detached:
        opts["lifetime"] = "detached"
    if spec.node_id:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(spec.node_id, soft=False)
    return WorkerActor.options(**opts).remote(spec.model_dump(), settings.model_dump())


def stop_workers(names: list[str] | None = None, prefix: str = WORKER_ACTOR_PREFIX) -> list[str]:
    """Stop and kill kvroute's named worker actors (all, or those of `names`). Returns the names."""
    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, NAMESPACE)
        if ns != NAMESPACE or not name.startswith(prefix):
            continue
        if names is not None and name[len(prefix):] not in names:
            continue
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            try:
                ray.get(handle.stop.remote(deregister=True), timeout=10)
            except Exception:
                pass
            ray.kill(handle, no_restart=True)
            killed.append(name[len(prefix):])
        except ValueError:
            continue
    return killed
