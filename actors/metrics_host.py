"""One metrics host per Ray node: a single async Ray actor hosting every attach-mode worker placed
on its node — each worker's metrics PULL, /health probe and model discovery — and pushing one
batched `HostFrame` per coalescing window to the aggregator, which is also the heartbeat of all
of them (liveness O(nodes), one Ray process floor per node instead of one per worker).

Which workers it hosts (`hostable`): attach mode without KV events. A managed worker keeps its own
`WorkerActor`: that actor is what reserves the engine's GPUs with Ray and owns the engine process.
A worker with KV events (exact prefix mode) keeps its own actor too: routers long-poll its KV log.

The host is named per node (`kvroute-metrics-host-<node id>`), detached, pinned to its node,
get-or-create. It remembers its workers' specs in Ray's internal KV, so Ray restarting it
(`max_restarts=-1`) brings its workers back; `stop()` forgets them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any

import httpx
import ray
import zmq
import zmq.asyncio
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.aggregator import get_or_create_aggregator
from actors.fleet import WorkerSpec
from actors.health import HealthProbe
from actors.host_pipe import HostPipe
from actors.ingest import MetricsBook
from actors.link import AggregatorLink
from actors.models import NAMESPACE, Settings
from actors.protocol import HostStats, RankMetrics, WorkerActorStats, WorkerReady, WorkerReport
from actors.worker_actor import _ipc_path, bind_pull

logger = logging.getLogger("kvroute.host")

HOST_PREFIX = "kvroute-metrics-host-"


def hostable(spec: WorkerSpec) -> bool:
    """True if `spec`'s metrics can live in its node's metrics host (attach mode, no KV events, no
    Ray resources to reserve); else it needs its own `WorkerActor`."""
    return (not spec.managed and spec.kv_events_endpoint is None and not spec.num_gpus and not spec.num_cpus
            and not spec.resources and spec.metrics_endpoint is not None)


class _Hosted:
    """One hosted worker: its PULL, book, liveness and report."""

    def __init__(self, spec: WorkerSpec, settings: Settings, ctx: zmq.asyncio.Context, http: httpx.AsyncClient,
                 on_change: Any) -> None:
        self.spec = spec
        self.name = spec.name
        self.incarnation = uuid.uuid4().hex[:12]
        self.book = MetricsBook(settings.max_frame_bytes)
        self.endpoint = spec.metrics_endpoint or ""
        self.sock = bind_pull(ctx, self.name, self.endpoint, settings.max_frame_bytes)
        self.health = HealthProbe(self.name, settings, http, on_change, models=spec.declared_models, discover=True)

    def report(self) -> WorkerReport:
        page = self.spec.page_size
        ranks = [RankMetrics(**d) for d in self.book.ranks_report(page).values()]
        return WorkerReport(name=self.name, url=self.spec.url or "", page_size=page, incarnation=self.incarnation,
                            healthy=self.health.healthy, health_detail=self.health.detail, ranks=ranks,
                            models=self.health.models, role=self.spec.role, bootstrap_port=self.spec.bootstrap_port,
                            dp_size=self.spec.dp_size)

    def close(self) -> None:
        self.sock.close(linger=0)
        path = _ipc_path(self.endpoint)
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class MetricsHost:
    """The metrics of every hosted worker on this node; methods address a worker by name."""

    def __init__(self, host: str, settings: dict[str, Any] | None = None) -> None:
        self.host = host
        self.settings = Settings.model_validate(settings or {})
        self._ctx = zmq.asyncio.Context()
        self._http = httpx.AsyncClient(timeout=self.settings.health_timeout_s)
        s = self.settings
        self._link = AggregatorLink(self._resolve_aggregator, ctx=self._ctx, hwm=s.max_pending_pushes,
                                    backoff_s=s.reconnect_backoff_s, backoff_max_s=s.reconnect_backoff_max_s)
        self._pipe = HostPipe(host, self._link, s)
        self._workers: dict[str, _Hosted] = {}
        self._stopping = False
        loop = asyncio.get_running_loop()
        for spec in _remembered(host):  # Ray restarted us: host the same workers again
            try:
                self._add(WorkerSpec.model_validate(spec))
            except Exception as exc:
                logger.error("host %s: cannot host worker %s again after a restart: %s", host, spec.get("name"), exc)
        self._tasks = [self._pipe.start(), loop.create_task(self._health_loop())]
        logger.info("metrics host %s up (%d workers)", host, len(self._workers))

    # --- lifecycle (Ray calls) ------------------------------------------------------------------

    async def add(self, spec: dict[str, Any]) -> WorkerReady:
        """Host a worker (idempotent for the same spec). Raises EndpointError if its metrics endpoint
        cannot be bound, ValueError if it is not hostable or another spec holds its name."""
        ws = WorkerSpec.model_validate(spec)
        have = self._workers.get(ws.name)
        if have is not None:
            if have.spec != ws:
                raise ValueError(f"worker {ws.name}: already hosted by {self.host} with another spec; remove it first")
        else:
            if not hostable(ws):
                raise ValueError(f"worker {ws.name}: not hostable (managed, KV events or Ray resources): "
                                 "it needs its own WorkerActor")
            self._add(ws)
            _remember(self.host, [w.spec.model_dump(mode="json") for w in self._workers.values()])
        return await self.ready(ws.name)

    async def ready(self, name: str) -> WorkerReady:
        w = self._get(name)
        return WorkerReady(name=name, url=w.spec.url or "", metrics_endpoint=w.endpoint,
                           node_id=ray.get_runtime_context().get_node_id(), managed=None)

    async def remove(self, name: str, deregister: bool = True) -> bool:
        """Stop hosting `name` (its socket closed, linger 0); `deregister`: drop it from the aggregator's
        fleet too (best effort, ≤ 0.5 s). False if it was not hosted."""
        w = self._workers.pop(name, None)
        if w is None:
            return False
        self._pipe.remove(name)
        w.close()
        _remember(self.host, [x.spec.model_dump(mode="json") for x in self._workers.values()])
        if deregister and self._link.handle is not None:
            try:
                await asyncio.wait_for(self._link.handle.remove.remote(name), timeout=0.5)
            except Exception:  # best effort: the aggregator may be gone already
                pass
        logger.info("host %s: worker %s removed", self.host, name)
        return True

    async def workers(self) -> list[str]:
        return list(self._workers)

    async def stats(self, name: str) -> WorkerActorStats:
        """What `WorkerActor.stats()` says, for hosted worker `name` (pushes are the host's frames)."""
        w = self._get(name)
        b = w.book.stats
        return WorkerActorStats(
            name=name, frames_received=b.frames_received, frames_accepted=b.frames_accepted,
            frames_refused=sum(b.refused.values()), refused_by_reason=dict(b.refused),
            pushes=self._link.sent, pushes_dropped=self._link.dropped, aggregator_connects=self._link.reconnects,
            healthy=w.health.healthy, health_detail=w.health.detail, aggregator_epoch=self._link.epoch,
            last_refusal=w.book.last_error, latest={r: m.model_dump() for r, m in w.book.latest().items()},
            kv_events=None)

    async def host_stats(self) -> HostStats:
        return HostStats(host=self.host, incarnation=self._pipe.incarnation, pid=os.getpid(),
                         workers=list(self._workers), frames=self._pipe.frames, full_frames=self._pipe.full_frames,
                         frames_dropped=self._link.dropped, aggregator_connects=self._link.reconnects)

    async def stop(self, deregister: bool = False) -> None:
        """Stop hosting every worker and forget them (a later restart hosts none). ≤ 1 s."""
        if self._stopping:
            return
        for name in list(self._workers):
            await self.remove(name, deregister=deregister)
        self._stopping = True
        _remember(self.host, [])
        self._pipe.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.wait({*self._tasks}, timeout=0.5)
        self._link.close()
        await self._http.aclose()
        self._ctx.term()

    # --- internals ------------------------------------------------------------------------------

    def _get(self, name: str) -> _Hosted:
        w = self._workers.get(name)
        if w is None:
            raise KeyError(f"worker {name}: not hosted by {self.host}")
        return w

    def _add(self, spec: WorkerSpec) -> None:
        w = _Hosted(spec, self.settings, self._ctx, self._http, lambda: self._pipe.mark(spec.name))
        self._workers[spec.name] = w
        self._pipe.add(spec.name, w.sock, w.book, w.report)
        logger.info("host %s: worker %s: PULL bound on %s, probing %s/health", self.host, spec.name, w.endpoint,
                    spec.url)

    async def _resolve_aggregator(self) -> Any:
        return await asyncio.to_thread(get_or_create_aggregator, self.settings)

    async def _health_loop(self) -> None:
        """Every hosted worker's /health, concurrently, every `health_interval_s`."""
        while True:
            try:
                started = time.monotonic()
                hosted = list(self._workers.values())
                if hosted:
                    await asyncio.gather(*(w.health.probe(w.spec.url) for w in hosted), return_exceptions=True)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("host %s: health probe error", self.host)
            await asyncio.sleep(max(0.0, self.settings.health_interval_s - (time.monotonic() - started)))


def _kv_key(host: str) -> bytes:
    return f"{host}-workers".encode()


def _remembered(host: str) -> list[dict[str, Any]]:
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        raw = _internal_kv_get(_kv_key(host), namespace=NAMESPACE)
        return json.loads(raw) if raw else []
    except Exception:
        logger.exception("host %s: cannot read its remembered workers", host)
        return []


def _remember(host: str, specs: list[dict[str, Any]]) -> None:
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    try:
        if specs:
            _internal_kv_put(_kv_key(host), json.dumps(specs).encode(), overwrite=True, namespace=NAMESPACE)
        else:
            _internal_kv_del(_kv_key(host), namespace=NAMESPACE)
    except Exception:
        logger.warning("host %s: cannot remember its workers; a restart will host none", host)


def host_name(node_id: str, prefix: str = HOST_PREFIX) -> str:
    return f"{prefix}{node_id[:16]}"


def get_or_create_host(node_id: str | None, settings: Settings, prefix: str = HOST_PREFIX) -> Any:
    """The metrics host of `node_id` (default: this process's node), created if absent: named,
    detached, pinned to the node. The first creator's settings are kept."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    name = host_name(node_id, prefix)
    return MetricsHost.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(name, settings.model_dump())


class _Bound:
    def __init__(self, method: Any, name: str, ref: Any = None) -> None:
        self._method, self._name, self._ref = method, name, ref

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(self._name, *args, **kwargs)


class HostedWorker:
    """A hosted worker addressed like a `WorkerActor` handle: `ready`, `stats`, `stop(deregister)`
    (`.remote()` each), all calls on its node's metrics host naming the worker."""

    def __init__(self, host: Any, name: str, added: Any) -> None:
        self.host, self.name, self._added = host, name, added

    @property
    def ready(self) -> Any:
        added = self._added

        class _Ready:
            def remote(self) -> Any:
                return added  # the add call's answer: a WorkerReady, or its error

        return _Ready()

    @property
    def stats(self) -> _Bound:
        return _Bound(self.host.stats, self.name)

    @property
    def stop(self) -> _Bound:
        return _Bound(self.host.remove, self.name)


def start_hosted_worker(spec: WorkerSpec, settings: Settings, prefix: str = HOST_PREFIX) -> HostedWorker:
    """Host `spec` in its node's metrics host (`spec.node_id`, else this process's node)."""
    host = get_or_create_host(spec.node_id, settings, prefix)
    return HostedWorker(host, spec.name, host.add.remote(spec.model_dump(mode="json")))


def list_hosts(prefix: str = HOST_PREFIX) -> list[str]:
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, NAMESPACE)
        if ns == NAMESPACE and name.startswith(prefix):
            out.append(name)
    return out


def remove_hosted(names: list[str] | None = None, prefix: str = HOST_PREFIX, deregister: bool = True) -> list[str]:
    """Stop hosting `names` on every metrics host (None: every worker, and kill the hosts).
    Returns the names of the workers that were hosted."""
    removed: list[str] = []
    for hname in list_hosts(prefix):
        try:
            host = ray.get_actor(hname, namespace=NAMESPACE)
            hosted = ray.get(host.workers.remote(), timeout=10)
            if names is None:
                try:
                    ray.get(host.stop.remote(deregister=deregister), timeout=10)
                except Exception:
                    pass
                ray.kill(host, no_restart=True)
                removed += hosted
                continue
            for n in hosted:
                if n in names and ray.get(host.remove.remote(n, deregister), timeout=10):
                    removed.append(n)
        except Exception as exc:  # a host that died meanwhile
            logger.warning("metrics host %s: %s", hname, exc)
    return removed


def start_worker(spec: WorkerSpec, settings: Settings, *, detached: bool = False, get_if_exists: bool = False) -> Any:
    """The worker's metrics plane as `settings.metrics_hosting` says: its node's metrics host when
    hostable, else its own `WorkerActor`. Returns a handle with `ready`/`stats`/`stop`."""
    from actors.worker_actor import start_worker_actor

    if settings.metrics_hosting == "node" and hostable(spec):
        return start_hosted_worker(spec, settings)
    return start_worker_actor(spec, settings, detached=detached, get_if_exists=get_if_exists)


def stop_workers(names: list[str] | None = None) -> list[str]:
    """Stop kvroute's workers, wherever hosted (all, or `names`): their actors stopped and killed,
    hosted ones removed from their metrics hosts (all: the hosts killed too). Returns the names."""
    from actors.worker_actor import kill_worker_actors

    return kill_worker_actors(names=names) + remove_hosted(names)
