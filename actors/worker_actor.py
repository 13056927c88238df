"""One async Ray actor per SGLang worker: binds the scheduler's metrics PULL, probes liveness,
and pushes coalesced reports to the aggregator without ever blocking its receive loop."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
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
from actors.ingest import MetricsBook
from actors.kv_events import KvEventError, SeqTracker, decode_kv_event_frame, is_replay_end, replay_reply
from actors.kv_handshake import KvEventsPlan, SilenceWatch, plan_subscription, rank_endpoint, shows_prefill
from actors.kv_log import KvLog
from actors.launcher import LaunchError, ManagedProcess
from actors.link import AggregatorLink
from actors.metrics_pipe import MetricsPipe
from actors.models import NAMESPACE, Settings
from actors.protocol import (
    KvEventsCounters, KvEventsStatus, KvHandshakeSide, KvLogAnswer, RankMetrics, WorkerActorStats, WorkerReady,
    WorkerReport,
)

logger = logging.getLogger("kvroute.worker")

_HARD_MSG_LIMIT_FACTOR = 16  # ZMQ drops peers sending above this × max_frame_bytes (memory bound)

class EndpointError(RuntimeError):
    """The worker's metrics endpoint cannot be bound (busy, bad path, no permission)."""


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def _ipc_in_use(path: str) -> bool:
    """True if a live process listens on this ipc path (a stale file is not 'in use')."""
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.2)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def bind_pull(ctx: zmq.asyncio.Context, name: str, endpoint: str, max_frame_bytes: int) -> zmq.asyncio.Socket:
    """Bind a PULL socket like the seed's loop; clear errors naming worker and endpoint."""
    path = _ipc_path(endpoint)
    if path is not None:
        if _ipc_in_use(path):
            raise EndpointError(
                f"worker {name}: metrics endpoint {endpoint} is busy (another process is bound to it); "
                "choose another path or stop that process"
            )
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            raise EndpointError(f"worker {name}: metrics endpoint {endpoint}: directory {parent} does not exist")
        if os.path.exists(path):
            os.unlink(path)  # stale file from a dead process
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes * _HARD_MSG_LIMIT_FACTOR)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        hint = " (address in use)" if exc.errno == errno.EADDRINUSE else ""
        raise EndpointError(f"worker {name}: cannot bind metrics endpoint {endpoint}: {exc}{hint}") from None
    return sock


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
        self.endpoint = self.spec.metrics_endpoint or _default_endpoint(self.name)
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
        self.kv_log: KvLog | None = None
        self._own_name: str | None = None
        self._kv_changed = asyncio.Event()
        self._kv_refused: dict[str, int] = {}
        self._kv_trackers: dict[int, SeqTracker] = {}
        self._kv_plans: list[KvEventsPlan] = []
        self._kv_batches = 0
        self._kv_replayed = 0
        self._kv_watch = SilenceWatch(self.settings.kv_events_silence_s)
        self._kv_warned = False
        self._kv_catch_up_at = 0.0
        self._kv_catching_up: asyncio.Task | None = None
        if self.spec.kv_events_endpoint:
            self._open_kv_subscription()  # before the engine starts: managed engines connect to us
        # one pooled client: SGLang's server keeps the connection alive, so a probe is one request
        self._http = httpx.AsyncClient(timeout=self.settings.health_timeout_s)
        # the model names it serves: as the fleet entry says, else (attach mode) its /v1/models once healthy
        self._health = HealthProbe(self.name, self.settings, self._http, self._wake.set,
                                   models=self.spec.declared_models, discover=not self.spec.managed)
        loop = asyncio.get_running_loop()
        self.proc: ManagedProcess | None = None
        self._launch: asyncio.Task | None = None
        if self.spec.managed:
            port = int(self.spec.url.rsplit(":", 1)[1]) if self.spec.url else None
            self.proc = ManagedProcess(self.spec, metrics_endpoint=self.endpoint, port=port,
                                       host=_listen_host(self.spec.host),
                                       on_change=self._on_process_change)
            self.url = self.proc.url
            self._launch = loop.create_task(self._start_process())
        self._tasks = [*self._pipe.start(), loop.create_task(self._health_loop())]
        if self.kv_log is not None:
            self._tasks.append(loop.create_task(self._kv_loop()))
        logger.info("worker %s: PULL bound on %s, probing %s/health", self.name, self.endpoint, self.url)

    def _open_kv_subscription(self) -> None:
        """Meet SGLang's KV-event publisher: bind the SUB where SGLang connects (a concrete tcp
        address, never a wildcard), connect where SGLang binds — SGLang's own rule (kv_handshake)."""
        self.kv_log = KvLog()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._kv_sock = sock
        ranks = self.spec.kv_event_ranks
        try:
            if self.spec.kv_events_endpoint == "auto":  # managed: we bind a port, the engine connects to it
                from actors.launcher import free_port

                host = _listen_host(self.spec.host)
                base = sock.bind_to_random_port(f"tcp://{host}")
                for r in range(1, ranks):  # rank r publishes on base + r
                    sock.bind(f"tcp://{host}:{base + r}")
                endpoint = f"tcp://{host}:{base}"
                # a connecting PUB loses what it sends before our subscription reached it (libzmq applies
                # it at the first send, so batch 0 is always lost): the engine's replay ROUTER, which
                # SGLang always binds, gives those batches back
                replay = self.spec.kv_events_replay_endpoint or f"tcp://{host}:{free_port(host)}"
                self.spec = self.spec.model_copy(update={"kv_events_endpoint": endpoint, "kv_events_bind": None,
                                                         "kv_events_replay_endpoint": replay})
                self._kv_plans = [KvEventsPlan(r, "bind", rank_endpoint(endpoint, r), rank_endpoint(replay, r))
                                  for r in range(ranks)]
            else:
                peer = self.spec.url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]") if self.spec.url else None
                self._kv_plans = plan_subscription(
                    self.spec.kv_events_endpoint, bind=self.spec.kv_events_bind,
                    replay_endpoint=self.spec.kv_events_replay_endpoint, ranks=ranks, peer_host=peer)
                for plan in self._kv_plans:
                    (sock.bind if plan.side == "bind" else sock.connect)(plan.address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise EndpointError(f"worker {self.name}: cannot subscribe to KV events on "
                                f"{self.spec.kv_events_endpoint}: {exc}") from None
        self._kv_opened_at = time.monotonic()
        for plan in self._kv_plans:
            logger.info("worker %s: KV events %s", self.name, plan.describe())

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
        return KvEventsStatus(
            status=self._kv_watch.state,
            handshake=[KvHandshakeSide(rank=p.rank, kvroute=p.side, address=p.address) for p in self._kv_plans],
            batches=self._kv_batches,
            detail=self._silence_detail() if self._kv_watch.state == "silent" else "",
        )

    def _silence_detail(self) -> str:
        sides = {p.side for p in self._kv_plans}
        if sides == {"bind"}:
            cause = ("kvroute binds, so SGLang must CONNECT: its --kv-events-config endpoint must be this concrete "
                     "address with no \"bind\": true, and not a wildcard / ipc:// form (those make SGLang bind)")
        else:
            cause = ("kvroute connects, so SGLang must BIND: give it tcp://*:PORT, ipc://PATH or (SGLang >= 0.5.22) "
                     "\"bind\": true — a plain tcp://HOST:PORT makes SGLang connect, and then both sides connect")
        return (f"no KV-event batch in {self.settings.kv_events_silence_s:.0f} s while KvMetrics show the engine "
                f"holding KV pages; likely a bind/connect mismatch: {cause}")

    def _watch_kv(self) -> None:
        if self.kv_log is None:
            return
        busy = any(shows_prefill(m.kv_active_blocks, self.spec.page_size, at, self._kv_opened_at)
                   for m, at in self.book.latest_with_times().values())
        before = self._kv_watch.state
        state = self._kv_watch.observe(time.monotonic(), self._kv_batches, busy)
        if state != before:
            self._wake.set()  # /workers shows it at the next push
        if state == "silent" and not self._kv_warned:
            self._kv_warned = True
            logger.warning("worker %s: KV events silent (%s) — %s", self.name,
                           "; ".join(p.describe() for p in self._kv_plans), self._silence_detail())

    # --- public methods -----------------------------------------------------------------------

    async def ready(self) -> WorkerReady:
        """Where the worker is; in managed mode only once its engine answers /health.
        Raises LaunchError if the engine cannot be started or never becomes healthy."""
        if self._launch is not None:
            await asyncio.shield(self._launch)
        return WorkerReady(name=self.name, url=self.url or "", metrics_endpoint=self.endpoint, node_id=_node_id(),
                           managed=self.proc.status.report() if self.proc else None)

    async def _start_process(self) -> None:
        assert self.proc is not None
        await self.proc.start()
        try:
            await self.proc.wait_healthy()
        except LaunchError:
            await self.proc.stop()
            raise

    async def stats(self) -> WorkerActorStats:
        b = self.book.stats
        return WorkerActorStats(
            name=self.name, frames_received=b.frames_received, frames_accepted=b.frames_accepted,
            frames_refused=sum(b.refused.values()), refused_by_reason=dict(b.refused),
            pushes=self._link.sent, pushes_dropped=self._link.dropped, aggregator_connects=self._link.reconnects,
            healthy=self.healthy, health_detail=self.health_detail, aggregator_epoch=self._link.epoch,
            last_refusal=self.book.last_error,
            latest={r: m.model_dump() for r, m in self.book.latest().items()},
            kv_events=None if self.kv_log is None else KvEventsCounters(
                seq=self.kv_log.seq, blocks=self.kv_log.blocks(), refused=dict(self._kv_refused),
                gaps=sum(t.gaps for t in self._kv_trackers.values()), replayed=self._kv_replayed,
                endpoint=self.spec.kv_events_endpoint, subscription=self._kv_info()),
        )

    @ray.method(enable_task_events=False)  # a long poll per router replica: no task-event bookkeeping
    async def kv_since(self, epoch: str | None, seq: int, timeout_s: float = 5.0) -> KvLogAnswer | None:
        """Long poll for router replicas: KV events after their cursor (or the whole state when the
        cursor is from another epoch or too old). None if this worker publishes no KV events."""
        if self.kv_log is None:
            return None
        if epoch == self.kv_log.epoch and seq >= self.kv_log.seq:
            event = self._kv_changed
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.kv_log.since(epoch, seq)

    async def stop(self, deregister: bool = True) -> None:
        """Close the socket (linger 0), stop the loops, optionally leave the registry. ≤ 1 s."""
        if self._stopping:
            return
        self._stopping = True
        self._pipe.stop()  # no push after this
        for t in self._tasks:
            t.cancel()
        if self._kv_catching_up is not None:
            self._kv_catching_up.cancel()
        # bounded: on Python 3.11 a wait_for racing the cancel can swallow it and keep a loop alive
        await asyncio.wait({*self._tasks}, timeout=0.5)
        if self.proc is not None:
            await self.proc.stop()
        self._sock.close(linger=0)
        if self.kv_log is not None:
            self._kv_sock.close(linger=0)
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
        await self._http.aclose()
        self._ctx.term()
        logger.info("worker %s: stopped", self.name)

    # --- KV events (exact prefix mode) ---------------------------------------------------------

    async def _kv_loop(self) -> None:
        assert self.kv_log is not None
        while True:
            try:
                frames = await self._kv_sock.recv_multipart()
                if is_replay_end(frames):
                    continue
                try:
                    batch = decode_kv_event_frame(frames)
                except KvEventError as exc:
                    self._kv_refused[exc.reason] = self._kv_refused.get(exc.reason, 0) + 1
                    continue
                self._kv_batches += 1
                if self._kv_watch.state != "ok":
                    self._watch_kv()
                tracker = self._kv_trackers.setdefault(batch.dp_rank, SeqTracker())
                status = tracker.observe(batch.seq)
                if status.kind == "restart":
                    logger.warning("worker %s: KV events restarted at seq %d (rank %d): the engine restarted; "
                                   "dropping that rank's entries", self.name, batch.seq, batch.dp_rank)
                    self.kv_log.lose_rank(batch.dp_rank)
                elif status.kind in ("gap", "first") and batch.seq > 0:
                    start = status.missing_from if status.kind == "gap" else 0
                    if not await self._replay(batch.dp_rank, start, batch.seq) and status.kind == "gap":
                        logger.warning("worker %s: KV events lost batches %d..%d (rank %d) and no replay "
                                       "covered them; dropping that rank's entries",
                                       self.name, status.missing_from, status.missing_to, batch.dp_rank)
                        self.kv_log.lose_rank(batch.dp_rank)
                if status.apply and batch.events:
                    self.kv_log.apply(batch.dp_rank, batch.events)
                self._kv_changed.set()
                self._kv_changed = asyncio.Event()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker %s: KV event loop error", self.name)
                await asyncio.sleep(0.01)

    async def _catch_up(self) -> None:
        """The engine shows prefills but no batch arrived: ask each rank's replay ROUTER from seq 0.
        Recovers batches a connecting PUB dropped before our subscription reached it (with nothing
        live after them to reveal the gap); if the replay is empty too, the watch stays `silent`."""
        if self._kv_batches or self._kv_watch.busy_since is None or time.monotonic() < self._kv_catch_up_at:
            return
        self._kv_catch_up_at = time.monotonic() + max(1.0, self.settings.kv_events_silence_s / 2)
        for plan in self._kv_plans:
            if plan.replay is not None and plan.rank not in self._kv_trackers:
                await self._replay(plan.rank, 0, None)
        self._watch_kv()

    async def _replay(self, rank: int, start: int, stop: int | None) -> bool:
        """Ask the rank's replay ROUTER for batches `start`..`stop - 1` (None: all it holds) and apply
        them in order. True only if every one of them arrived (the engine's buffer still held them)."""
        assert self.kv_log is not None
        plan = next((p for p in self._kv_plans if p.rank == rank), None)
        if plan is None or plan.replay is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
        got: dict[int, Any] = {}
        try:
            dealer.connect(plan.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.settings.kv_events_replay_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not await dealer.poll(left * 1000):
                    break
                try:
                    frames = replay_reply(await dealer.recv_multipart())
                    if frames is None:
                        break
                    b = decode_kv_event_frame(frames)
                except KvEventError as exc:
                    self._kv_refused[exc.reason] = self._kv_refused.get(exc.reason, 0) + 1
                    continue
                if start <= b.seq and (stop is None or b.seq < stop):
                    got[b.seq] = b
        finally:
            dealer.close(linger=0)
        for seq in sorted(got):
            if got[seq].events:
                self.kv_log.apply(rank, got[seq].events)
        self._kv_replayed += len(got)
        if stop is None:  # caught up from nothing: the live stream continues after the newest one
            if got:
                self._kv_trackers.setdefault(rank, SeqTracker()).observe(max(got))
                self._kv_batches += len(got)
                self._kv_changed.set()
                self._kv_changed = asyncio.Event()
            complete, stop = bool(got), (max(got) + 1 if got else start)
        else:
            complete = len(got) == stop - start
        if got:
            logger.info("worker %s: KV events replayed %d of batches %d..%d (rank %d)",
                        self.name, len(got), start, stop - 1, rank)
        return complete

    # --- push ---------------------------------------------------------------------------------

    def _report(self) -> WorkerReport:
        page = self.spec.page_size
        ranks = [RankMetrics(**d) for d in self.book.ranks_report(page).values()]
        kv = self.kv_log is not None  # routers follow this actor's KV log (exact prefix mode)
        return WorkerReport(name=self.name, url=self.url or "", page_size=page, incarnation=self.incarnation,
                            healthy=self.healthy, health_detail=self.health_detail, ranks=ranks,
                            managed=self.proc.status.report() if self.proc else None,
                            kv_events_actor=self._actor_name() if kv else None,
                            kv_events=self._kv_info() if kv else None, models=self.models,
                            role=self.spec.role, bootstrap_port=self.spec.bootstrap_port, dp_size=self.spec.dp_size)

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
        while True:
            try:
                await self._probe()
                self._watch_kv()
                if self._kv_catching_up is None or self._kv_catching_up.done():
                    self._kv_catching_up = asyncio.get_running_loop().create_task(self._catch_up())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker %s: health probe error", self.name)
            await asyncio.sleep(self.settings.health_interval_s)


def _listen_host(host: str) -> str:
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


def _default_endpoint(name: str) -> str:
    """Managed workers get a node-local ipc:// path chosen here (SGLang's own is random)."""
    import tempfile

    return f"ipc://{tempfile.gettempdir()}/kvroute-{name}-{os.getpid()}.metrics"


def _node_id() -> str | None:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


WORKER_ACTOR_PREFIX = "kvroute-worker-"


def start_worker_actor(
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


def kill_worker_actors(prefix: str = WORKER_ACTOR_PREFIX, names: list[str] | None = None) -> list[str]:
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
