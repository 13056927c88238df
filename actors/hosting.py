"""The host role, written once: every hosted worker's metrics PULL, its /health probe (passive while its
KvMetrics frames arrive) and model discovery, and one `HostPipe` sending one batched frame per window
for all of them — which is also their heartbeat. The host also owns the engine process of every
managed worker it hosts (`actors.launcher.ManagedProcess` under a keeper: launch, /health, restarts,
stop, adoption after the host's restart) and serves their KV logs in exact prefix mode.

Two actors run it: a node's `MetricsHost` (`actors.metrics_host`), whose pipe pushes over an
`AggregatorLink`, and the aggregator itself for the workers on its own node (`actors.aggregator`),
whose pipe hands its frames to its registry in-process (`LocalLink`: no ZeroMQ hop to itself, no
host process). `HostingCalls` gives both actors the same Ray methods. No Ray calls but the spec
memory in Ray's internal KV (`remember` / `remembered`), which imports Ray where it is used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any, Awaitable, Callable

import httpx
import msgspec
import zmq
import zmq.asyncio

from actors.endpoint import _ipc_path, bind_pull, default_endpoint
from actors.fleet import WorkerSpec
from actors.health import HealthProbe, probe_client
from actors.host_pipe import HostPipe
from actors.ingest import MetricsBook
from actors.kv_handshake import shows_prefill
from actors.kv_subscriber import KvSubscriber, subscribe_for
from actors.launcher import LaunchError, ManagedProcess
from actors.models import NAMESPACE, Settings
from actors.protocol import HostStats, KvLogAnswer, WorkerActorStats, WorkerReady, WorkerReport

logger = logging.getLogger("kvroute.host")


def hostable(spec: WorkerSpec) -> bool:
    """True if `spec` can live in its node's host: a managed engine (the host owns the process; its Ray
    resources, if any, are held by a placement group: `actors.reservation`), or attach mode with its
    metrics endpoint and no Ray resources to hold. Else it needs its own `WorkerActor`."""
    return spec.managed or (spec.metrics_endpoint is not None and not needs_reservation(spec))


def needs_reservation(spec: WorkerSpec) -> bool:
    """True if `spec` asks Ray for resources (`num_gpus`, `num_cpus`, `resources`)."""
    return bool(spec.num_gpus or spec.num_cpus or spec.resources)


ENGINE_KEY = "kvroute_engine"  # in a remembered spec: where its engine's keeper is
ENV_KEY = "kvroute_engine_env"  # … and the environment it is launched with (its reserved GPUs)


class EngineMemory(msgspec.Struct, frozen=True):
    """Where a hosted managed engine runs, remembered with its spec so a restarted host adopts it."""

    control: str  # its keeper's Unix socket
    port: int  # its HTTP port
    endpoint: str  # the metrics endpoint it pushes to


def split_memory(entry: dict[str, Any]) -> tuple[WorkerSpec, EngineMemory | None, dict[str, str]]:
    """A remembered entry → (its spec, where its engine is if any, its engine's environment). Raises
    on a malformed one."""
    entry = dict(entry)
    engine = entry.pop(ENGINE_KEY, None)
    env = msgspec.convert(entry.pop(ENV_KEY, None) or {}, dict[str, str])
    return WorkerSpec.model_validate(entry), (msgspec.convert(engine, EngineMemory) if engine else None), env


class LocalLink:
    """The pipe's sink inside the aggregator: `push_host` applies the frame to the registry at once
    (`apply(host, incarnation, workers, reports)`). Always connected, never drops; the same surface
    as `AggregatorLink` where `HostPipe`/`PushWindow` use it."""

    handle = None
    epoch = None
    dropped = 0
    reconnects = 0
    connections = 1  # one "connection" for the process's life: the first frame carries every report
    # no heartbeat frames: the host is the aggregator itself, alive while it can apply them (the
    # registry pins an in-process host up); the push loop still sends woken changes at once
    heartbeat_s = 3600.0

    def __init__(self, apply: Callable[[str, str, list[str], list[WorkerReport]], None]) -> None:
        """`apply(host, incarnation, workers, reports)`: the aggregator's registry takes the frame."""
        self._apply = apply
        self.sent = 0
        self.window_s: float | None = None  # the fleet-wide window, set by the aggregator (None: coalesce_s)

    def ready(self) -> bool:
        return True

    async def ensure(self) -> bool:
        return True

    def push_host(self, host: str, incarnation: str, workers: list[str], reports: list[WorkerReport]) -> bool:
        self._apply(host, incarnation, workers, reports)
        self.sent += 1
        return True

    def close(self) -> None:
        pass


class Hosted:
    """One hosted worker: its PULL, book, liveness and report — and, managed, its engine process
    (launched at once; `launch` is the task that ends when it answers /health)."""

    def __init__(self, spec: WorkerSpec, settings: Settings, ctx: zmq.asyncio.Context, http: httpx.AsyncClient,
                 on_change: Callable[[], None], engine_host: str = "127.0.0.1", *,
                 adopt: EngineMemory | None = None, env: dict[str, str] | None = None,
                 on_engine: Callable[[], None] = lambda: None, actor_name: str | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.incarnation = uuid.uuid4().hex[:12]
        self.book = MetricsBook(settings.max_frame_bytes)
        # an adopted engine keeps pushing to the endpoint it was launched with
        self.endpoint = adopt.endpoint if adopt else (
            spec.metrics_endpoint or (default_endpoint(spec.name) if spec.managed else ""))
        self._on_change = on_change
        self._on_engine = on_engine
        self.env = dict(env or {})
        self.sock = bind_pull(ctx, self.name, self.endpoint, settings.max_frame_bytes)
        # exact prefix mode: its KV events, subscribed before a managed engine starts (it connects to us);
        # routers long-poll them through this host (`kv_since(worker=…)` on `actor_name`)
        self.kv: KvSubscriber | None = None
        self.actor_name = actor_name
        if spec.kv_events_endpoint:
            try:
                self.kv, spec = subscribe_for(spec, ctx, settings, listen_host=engine_host, on_change=on_change)
            except Exception:
                self.sock.close(linger=0)
                raise
            self.spec = spec
            self._kv_task = self.kv.start()
        self.health = HealthProbe(self.name, settings, http, on_change, models=spec.declared_models,
                                  discover=not spec.managed)
        self.proc: ManagedProcess | None = None
        self.launch: asyncio.Task | None = None
        if spec.managed:
            port = adopt.port if adopt else (int(spec.url.rsplit(":", 1)[1]) if spec.url else None)
            self.proc = ManagedProcess(spec, metrics_endpoint=self.endpoint, port=port, host=engine_host,
                                       orphan_grace_s=settings.engine_adopt_grace_s, env=self.env,
                                       control=adopt.control if adopt else None, on_change=self._on_process_change)
            self.launch = asyncio.get_running_loop().create_task(self.proc.launch())
        self.url = self.proc.url if self.proc is not None else (spec.url or "")

    def _on_process_change(self) -> None:
        # a dead engine is down now, not at the next probe
        if self.proc is not None and not self.proc.alive:
            self.health.set(False, f"engine process {self.proc.status.state}: {self.proc.status.detail}")
        self._on_engine()  # a new keeper: remember where a restarted host finds it
        self._on_change()

    def watch_kv(self) -> None:
        """While the engine shows prefills but no KV batch came: ask for a replay (`KvSubscriber.watch`)."""
        if self.kv is not None:
            busy = any(shows_prefill(m.kv_active_blocks, self.spec.page_size, at, self.kv.opened_at)
                       for m, at in self.book.latest_with_times().values())
            self.kv.watch(busy)

    def memory(self) -> dict[str, Any]:
        """The spec, and for a managed worker where its engine is (`ENGINE_KEY`): what a restarted host
        needs to host it again and adopt its engine."""
        out = self.spec.model_dump(mode="json")
        if self.proc is not None and self.proc.control:
            out[ENGINE_KEY] = msgspec.to_builtins(EngineMemory(self.proc.control, self.proc.port, self.endpoint))
        if self.env:
            out[ENV_KEY] = dict(self.env)
        return out

    def report(self) -> WorkerReport:
        page = self.spec.page_size
        ranks = self.book.rank_metrics(page)
        return WorkerReport(name=self.name, url=self.url, page_size=page, incarnation=self.incarnation,
                            healthy=self.health.healthy, health_detail=self.health.detail, ranks=ranks,
                            managed=self.proc.status.report() if self.proc is not None else None,
                            kv_events_actor=self.actor_name if self.kv is not None else None,
                            kv_events=self.kv.info() if self.kv is not None else None,
                            models=self.health.models, role=self.spec.role, bootstrap_port=self.spec.bootstrap_port,
                            dp_size=self.spec.dp_size)

    def ready(self, node_id: str | None) -> WorkerReady:
        return WorkerReady(name=self.name, url=self.url, metrics_endpoint=self.endpoint, node_id=node_id,
                           managed=self.proc.status.report() if self.proc is not None else None)

    def probe_due(self) -> float:
        return self.health.due(self.book.heard_at())

    async def probe(self) -> None:
        if self.proc is not None and not self.proc.alive:
            self.health.set(False, f"engine process {self.proc.status.state}")
            return
        await self.health.probe(self.url)

    async def aclose(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after its grace) and the KV subscription, then close
        the socket."""
        if self.launch is not None and not self.launch.done():
            self.launch.cancel()
        if self.proc is not None:
            await self.proc.stop()
        if self.kv is not None:
            await self.kv.close()
        self.sock.close(linger=0)
        path = _ipc_path(self.endpoint)
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass


class NodeHosting:
    """The hosted workers of one node, pushed through `link` (an `AggregatorLink`, or a `LocalLink`).

    `deregister(name)` drops a removed worker from the aggregator's fleet; `remember(specs)` keeps
    the hosted specs where a restarted actor finds them (`remembered(key)`). `engines`: this host may
    own managed engines, listening where `listen_host(spec.host)` says; `release(name)` frees the
    Ray resources held for a removed one. Start with `start()` inside the event loop, end
    with `await stop()`."""

    def __init__(self, host: str, node_id: str | None, settings: Settings, ctx: zmq.asyncio.Context, link: Any, *,
                 deregister: Callable[[str], Awaitable[Any]], remember: Callable[[list[dict[str, Any]]], None],
                 engines: bool = False, listen_host: Callable[[str], str] | None = None,
                 release: Callable[[str], Any] | None = None) -> None:
        self.host = host
        self._release = release
        self.engines = engines
        self._listen_host = listen_host or (lambda h: "127.0.0.1" if h == "auto" else h)
        self.node_id = node_id
        self.settings = settings
        self.link = link
        self._ctx = ctx
        self._http = probe_client(settings)
        self._deregister = deregister
        self._remember = remember
        self.pipe = HostPipe(host, link, settings, heartbeat_s=getattr(link, "heartbeat_s", None))
        self.workers: dict[str, Hosted] = {}
        self._saved: list[dict[str, Any]] | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [self.pipe.start(), loop.create_task(self._health_loop())]

    def restore(self, entries: list[dict[str, Any]]) -> None:
        """Host the remembered `entries` again (after this actor's restart), adopting their engines."""
        for entry in entries:
            try:
                spec, engine, env = split_memory(entry)
                self.add(spec, adopt=engine, env=env)
            except Exception as exc:
                logger.error("host %s: cannot host worker %s again after a restart: %s", self.host, entry.get("name"),
                             exc)

    def add(self, spec: WorkerSpec, adopt: EngineMemory | None = None, env: dict[str, str] | None = None) -> bool:
        """Host `spec` (idempotent for the same spec); False if it was hosted already. A managed spec's
        engine starts now with `env` added (`await ready(name)` waits for its /health), or is adopted
        (`adopt`). Raises EndpointError if its metrics endpoint cannot be bound, ValueError if it is
        not hostable here or another spec holds its name."""
        have = self.workers.get(spec.name)
        if have is not None:
            if have.spec != spec:
                raise ValueError(f"worker {spec.name}: already hosted by {self.host} with another spec; remove it "
                                 "first")
            return False
        if not hostable(spec):
            raise ValueError(f"worker {spec.name}: not hostable (attach mode with Ray resources or without a metrics "
                             "endpoint): it needs its own WorkerActor")
        if spec.managed and not self.engines:
            raise ValueError(f"worker {spec.name}: {self.host} does not own engines; a managed worker's engine "
                             "belongs to its node's metrics host")
        engine_host = self._listen_host(spec.host) if spec.managed else "127.0.0.1"
        w = Hosted(spec, self.settings, self._ctx, self._http, lambda: self.pipe.mark(spec.name), engine_host,
                   adopt=adopt, env=env, on_engine=self._save, actor_name=self.host)
        self.workers[spec.name] = w
        self.pipe.add(spec.name, w.sock, w.book, w.report)
        self._save()
        logger.info("host %s: worker %s: PULL bound on %s, %s %s/health", self.host, spec.name, w.endpoint,
                    "engine starting," if spec.managed else "probing", w.url)
        return True

    async def ready(self, name: str) -> WorkerReady:
        """Where hosted worker `name` is; a managed one once its engine answers /health. Raises
        LaunchError if its engine cannot start or never becomes healthy (it stays hosted, engine
        stopped, until removed)."""
        w = self._get(name)
        if w.launch is not None:
            await asyncio.shield(w.launch)
        return w.ready(self.node_id)

    async def remove(self, name: str, deregister: bool = True) -> bool:
        """Stop hosting `name` (its socket closed, linger 0); `deregister`: drop it from the aggregator's
        fleet too (best effort, ≤ 0.5 s). False if it was not hosted."""
        w = self.workers.pop(name, None)
        if w is None:
            return False
        self.pipe.remove(name)
        await w.aclose()
        self._save()
        if self._release is not None and w.spec.managed and needs_reservation(w.spec):
            try:  # its engine is gone: free what Ray held for it
                await asyncio.to_thread(self._release, name)
            except Exception as exc:
                logger.warning("host %s: worker %s: cannot release its Ray resources: %s", self.host, name, exc)
        if deregister:
            try:
                await asyncio.wait_for(self._deregister(name), timeout=0.5)
            except Exception:  # best effort: the aggregator may be gone already
                pass
        logger.info("host %s: worker %s removed", self.host, name)
        return True

    async def kv_since(self, name: str | None, epoch: str | None, seq: int, timeout_s: float) -> KvLogAnswer | None:
        """A router's long poll on hosted worker `name`'s KV events (`WorkerActor.kv_since`); None if it
        publishes none or is not hosted here (any more)."""
        w = self.workers.get(name) if name else None
        if w is None or w.kv is None:
            return None
        return await w.kv.since(epoch, seq, timeout_s)

    def worker_stats(self, name: str) -> WorkerActorStats:
        """What `WorkerActor.stats()` says, for hosted worker `name` (pushes are the host's frames)."""
        w = self._get(name)
        b = w.book.stats
        link = self.link
        return WorkerActorStats(
            name=name, frames_received=b.frames_received, frames_accepted=b.frames_accepted,
            frames_refused=sum(b.refused.values()), refused_by_reason=dict(b.refused),
            pushes=link.sent, pushes_dropped=link.dropped, aggregator_connects=link.reconnects,
            healthy=w.health.healthy, health_detail=w.health.detail, aggregator_epoch=link.epoch,
            last_refusal=w.book.last_error, latest={r: m.model_dump() for r, m in w.book.latest().items()},
            kv_events=None if w.kv is None else w.kv.counters())

    def host_stats(self) -> HostStats:
        return HostStats(host=self.host, incarnation=self.pipe.incarnation, pid=os.getpid(),
                         workers=list(self.workers), frames=self.pipe.frames, full_frames=self.pipe.full_frames,
                         frames_dropped=self.link.dropped, aggregator_connects=self.link.reconnects,
                         health_probes=sum(w.health.probes for w in self.workers.values()),
                         window_s=getattr(self.link, "window_s", None))

    async def remove_all(self, deregister: bool = False) -> list[str]:
        """Stop hosting every worker and forget them (a later restart hosts none); keeps running.
        Their engines stop concurrently."""
        names = list(self.workers)
        await asyncio.gather(*(self.remove(name, deregister=deregister) for name in names))
        return names

    async def stop(self, deregister: bool = False) -> None:
        """`remove_all`, then end the pipe and the probes (no frame after it). ≤ 1 s, plus an engine's
        stop grace if one ignores SIGTERM."""
        if self._stopping:
            return
        await self.remove_all(deregister)
        self._stopping = True
        self.pipe.stop()
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait({*self._tasks}, timeout=0.5)
        await self._http.aclose()

    # --- internals ------------------------------------------------------------------------------

    def _save(self) -> None:
        """Remember the hosted workers (and where their engines are) when that changed."""
        memory = [w.memory() for w in self.workers.values()]
        if memory != self._saved:
            self._saved = memory
            self._remember(memory)

    def _get(self, name: str) -> Hosted:
        w = self.workers.get(name)
        if w is None:
            raise KeyError(f"worker {name}: not hosted by {self.host}")
        return w

    async def _health_loop(self) -> None:
        """Each hosted worker's /health when it is due (`HealthProbe.due`: every `health_interval_s`
        while its frames are silent or it fails, else every `health_busy_interval_s`), concurrently."""
        interval = self.settings.health_interval_s
        while True:
            try:
                now = time.monotonic()
                hosted = list(self.workers.values())
                due = [w for w in hosted if w.probe_due() <= now]
                if due:
                    await asyncio.gather(*(w.probe() for w in due), return_exceptions=True)
                for w in hosted:
                    w.watch_kv()  # at least every health_interval_s
                wake = min((w.probe_due() for w in self.workers.values()), default=now + interval)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("host %s: health probe error", self.host)
                wake = time.monotonic() + interval
            await asyncio.sleep(min(max(0.0, wake - time.monotonic()), interval))


class HostingCalls:
    """The Ray methods of an actor that hosts workers (a `MetricsHost`, the aggregator): its
    `NodeHosting` is `self._hosting`. Every method addresses a worker by name."""

    _hosting: NodeHosting

    async def add_worker(self, spec: dict[str, Any], adopt: dict[str, Any] | None = None,
                         env: dict[str, str] | None = None) -> WorkerReady:
        """Host a worker (idempotent for the same spec) and answer once it is ready (`NodeHosting.add`,
        `NodeHosting.ready`); `adopt`: an `EngineMemory` (as a dict) of its running engine; `env`: its
        engine's environment (`Reservation.env()`). A managed engine that cannot start is removed
        again and its LaunchError raised."""
        ws = WorkerSpec.model_validate(spec)
        self._check_node(ws)
        self._hosting.add(ws, adopt=msgspec.convert(adopt, EngineMemory) if adopt else None,
                          env=msgspec.convert(env or {}, dict[str, str]))
        try:
            return await self._hosting.ready(ws.name)
        except LaunchError:
            await self._hosting.remove(ws.name)  # nothing half-started stays behind (nor comes back on a restart)
            raise

    async def ready_worker(self, name: str) -> WorkerReady:
        return await self._hosting.ready(name)

    async def remove_worker(self, name: str, deregister: bool = True) -> bool:
        return await self._hosting.remove(name, deregister)

    async def hosted_workers(self) -> list[str]:
        return list(self._hosting.workers)

    async def worker_stats(self, name: str) -> WorkerActorStats:
        return self._hosting.worker_stats(name)

    async def kv_since(self, epoch: str | None, seq: int, timeout_s: float = 5.0,
                       worker: str | None = None) -> KvLogAnswer | None:
        """Routers' long poll on hosted `worker`'s KV events (exact prefix mode), as `WorkerActor.kv_since`."""
        return await self._hosting.kv_since(worker, epoch, seq, timeout_s)

    async def host_stats(self) -> HostStats:
        return self._hosting.host_stats()

    async def stop_hosting(self, deregister: bool = False) -> None:
        """Stop hosting every worker and forget them (a later restart hosts none). ≤ 1 s. The
        aggregator keeps hosting what is added later; a `MetricsHost` ends (it is killed next)."""
        await self._hosting.remove_all(deregister=deregister)

    async def node_id(self) -> str | None:
        return self._hosting.node_id

    def _check_node(self, spec: WorkerSpec) -> None:
        node = self._hosting.node_id
        if spec.node_id and node and spec.node_id != node:
            raise ValueError(f"worker {spec.name}: placed on node {spec.node_id}, not on {self._hosting.host}'s node "
                             f"{node}: its node's metrics host must bind its endpoint")


# --- hosted specs across restarts (Ray's internal KV) ---------------------------------------------


def remembered(key: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the node they were hosted on, the specs) last remembered under `key`; (None, []) if none."""
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        raw = _internal_kv_get(key.encode(), namespace=NAMESPACE)
        saved = json.loads(raw) if raw else {}
        if isinstance(saved, list):  # written before the node was remembered
            return None, saved
        return saved.get("node_id"), list(saved.get("workers", []))
    except Exception:
        logger.exception("cannot read the hosted workers remembered under %s", key)
        return None, []


def remember(key: str, node_id: str | None, specs: list[dict[str, Any]]) -> None:
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    try:
        if specs:
            _internal_kv_put(key.encode(), json.dumps({"node_id": node_id, "workers": specs}).encode(),
                             overwrite=True, namespace=NAMESPACE)
        else:
            _internal_kv_del(key.encode(), namespace=NAMESPACE)
    except Exception:
        logger.warning("cannot remember the hosted workers under %s; a restart will host none", key)
