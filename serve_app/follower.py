"""Keeps a router replica's local copy of the aggregator's fleet view, off the request path:
requests read `FleetFollower.workers`, never wait on an actor call.

The copy follows the aggregator's delta stream (ZeroMQ SUB, msgspec frames, at most one delta per
coalescing window); Ray is used only to find the aggregator and to fetch a full snapshot when the
follower starts, misses a delta or sees a new epoch (the aggregator restarted)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from actors.models import sum_ranks
from actors.protocol import (
    MAX_DELTA_FRAME_BYTES, Adapter, FleetDelta, KvEventsStatus, ManagedEngine, ProtocolError, decode_delta,
)
from actors.transport.readable import SocketWatch
from actors.transport.retry import Backoff, reconnecting

logger = logging.getLogger("kvroute.follower")

_DRAIN_BATCH = 256


class WorkerRecord(msgspec.Struct, kw_only=True):
    """One worker as last reported, with ages turned into this replica's monotonic clock.
    Built with keywords only; a follower updates `ranks`, `metrics`, `metrics_at` and `updated_at`
    in place when only the ranks changed."""

    name: str
    url: str
    page_size: int
    state: str  # live | idle | down
    healthy: bool
    health_detail: str = ""
    metrics: dict[str, Any] | None = None  # the ranks summed (one rank: its values)
    ranks: list[dict[str, Any]] = []
    metrics_at: float | None = None  # local monotonic time of the newest frame (None: never reported)
    heartbeat_at: float
    updated_at: float = 0.0  # wall clock when this replica applied the record (freshness measurements)
    in_flight_by_replica: dict[str, int] = {}
    managed: ManagedEngine | None = None
    kv_events_actor: str | None = None  # the worker actor to follow for KV events (exact prefix mode)
    kv_events: KvEventsStatus | None = None
    models: list[str] = []  # the model names the worker serves ([] = unknown)
    role: str = "both"  # PD disaggregation role: prefill | decode | both (docs/pd.md)
    bootstrap_port: int | None = None  # role prefill: its --disaggregation-bootstrap-port
    dp_size: int = 1  # attention-DP ranks (the fleet entry's dp_size): > 1 → one routing target per rank
    adapters: list[Adapter] = []  # the LoRA adapters it has loaded (its /v1/models entries with a parent)
    rank_at: dict[int, float] = {}  # local monotonic time of each rank's newest frame

    def managed_view(self) -> dict[str, Any] | None:
        """What /workers shows as `managed`: the engine process, and the KV-event subscription."""
        view: dict[str, Any] = {}
        if self.managed is not None:
            view.update(msgspec.structs.asdict(self.managed))
        if self.kv_events_actor is not None:
            view["kv_events_actor"] = self.kv_events_actor
        if self.kv_events is not None:
            kv = self.kv_events
            view["kv_events"] = {"status": kv.status, "batches": kv.batches,
                                 "handshake": [msgspec.structs.asdict(h) for h in kv.handshake],
                                 **({"detail": kv.detail} if kv.detail else {})}
        return view or None


class _Resync(Exception):
    """The stream and our copy disagree (new epoch, missed delta): fetch a full snapshot."""


class FleetFollower:
    """Applies aggregator deltas; survives the aggregator restarting (epoch change → full resync)
    and being unreachable (keeps the last view; `health()` reports the staleness)."""

    def __init__(
        self,
        resolve: Callable[[], Awaitable[Any]],
        *,
        poll_timeout_s: float = 5.0,
        backoff_s: float = 0.1,
        backoff_max_s: float = 0.5,
        silence_s: float = 1.5,
        resync_grace_s: float = 3.0,
        on_update: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._resolve = resolve
        self.poll_timeout_s = poll_timeout_s  # timeout of Ray calls (endpoints, snapshot)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.silence_s = silence_s
        # a restarted aggregator is rebuilt from the workers' next heartbeats (≤ heartbeat_s): a
        # worker its first snapshot lacks is kept this long, then dropped if it never came back
        self.resync_grace_s = resync_grace_s
        self.on_update = on_update
        self._carried: dict[str, float] = {}  # worker → when it is dropped unless a delta names it
        self.workers: dict[str, WorkerRecord] = {}
        # the router replicas sharing in-flight counts through the aggregator (this one included once it shared)
        self.replicas: frozenset[str] = frozenset()
        self.epoch: str | None = None
        self.version = 0
        self.connected = False
        self.last_ok_at: float | None = None
        self.last_error: str | None = None
        self.updates = 0  # deltas applied (keep-alives not counted)
        self.resyncs = 0
        self.restarts_followed = 0  # restarted aggregators followed from their stream's start (no snapshot)
        self.bytes_received = 0
        self.frames_received = 0  # deltas, keep-alives and snapshots
        self._task: asyncio.Task | None = None
        self._first = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def wait_first(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._first.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def snapshot_age_s(self) -> float | None:
        return None if self.last_ok_at is None else time.monotonic() - self.last_ok_at

    def apply(self, delta: FleetDelta, received_at: float | None = None) -> list[str]:
        """Merge one delta (or full snapshot). Returns the names that changed."""
        now = time.monotonic() if received_at is None else received_at
        wall = time.time()
        fresh: dict[str, WorkerRecord] = {} if delta.full or delta.epoch != self.epoch else self.workers
        changed: list[str] = []
        if fresh is not self.workers:
            if delta.epoch != self.epoch and self.epoch is not None:  # a restarted aggregator: carry the
                # workers over until they re-register or their grace ends (a partial first snapshot
                # must not empty the router)
                deadline = now + self.resync_grace_s
                for name, rec in self.workers.items():
                    fresh[name] = rec
                    self._carried.setdefault(name, deadline)
            else:  # the same aggregator's full state: who is not in it left the fleet
                present = {w.name for w in delta.workers}
                changed.extend(n for n in self.workers if n not in present)
                self._carried.clear()
        carried = self._carried
        for w in delta.workers:
            age = w.metrics_age_s
            ranks = [r.values() for r in w.ranks]
            fresh[w.name] = WorkerRecord(
                name=w.name, url=w.url, page_size=w.page_size, state=w.state, healthy=w.healthy,
                health_detail=w.health_detail, metrics=(dict(ranks[0]) if len(ranks) == 1 else sum_ranks(ranks)),
                ranks=ranks, metrics_at=None if age is None else now - age, heartbeat_at=now - w.heartbeat_age_s,
                updated_at=wall, in_flight_by_replica=w.in_flight_by_replica,  # freshly decoded: ours to keep
                managed=w.managed, kv_events_actor=w.kv_events_actor, kv_events=w.kv_events,
                models=w.models, role=w.role, bootstrap_port=w.bootstrap_port, dp_size=w.dp_size,
                adapters=w.adapters, rank_at=_rank_times(w.ranks, None if age is None else now - age),
            )
            changed.append(w.name)
            if carried:
                carried.pop(w.name, None)
        for u in delta.metrics:  # ranks alone changed: update the record we hold in place
            rec = fresh.get(u.name)
            if rec is None:
                continue
            ranks = [r.values() for r in u.ranks]
            rec.ranks = ranks
            rec.metrics = dict(ranks[0]) if len(ranks) == 1 else sum_ranks(ranks)
            rec.metrics_at = now - u.metrics_age_s
            rec.heartbeat_at = max(rec.heartbeat_at, rec.metrics_at)  # the report that brought them
            rec.rank_at = _rank_times(u.ranks, rec.metrics_at)
            rec.updated_at = wall
            changed.append(u.name)
        if delta.heard:
            self.heard(delta.heard, fresh, now)
        if delta.names is not None:
            names = set(delta.names)
            for gone in [n for n in fresh if n not in names and n not in carried]:
                del fresh[gone]
                changed.append(gone)
        if delta.replicas is not None or delta.full:
            self.replicas = frozenset(delta.replicas or ())
        self.workers = fresh
        if carried:
            changed += self.expire_carried(now)
        self.epoch = delta.epoch
        self.version = delta.version
        return changed

    def heard(self, names: list[str], workers: dict[str, WorkerRecord] | None = None, now: float | None = None) -> None:
        """Workers whose heartbeat alone arrived (`FleetDelta.heard`): no new version, a fresher
        `heartbeat_at` (what /workers shows as `heartbeat_age_s`)."""
        workers = self.workers if workers is None else workers
        now = time.monotonic() if now is None else now
        for name in names:
            rec = workers.get(name)
            if rec is not None:
                rec.heartbeat_at = now

    def expire_carried(self, now: float | None = None) -> list[str]:
        """Drop the workers carried over a restart whose grace ended without a delta naming them."""
        now = time.monotonic() if now is None else now
        gone = [n for n, deadline in self._carried.items() if now >= deadline]
        for n in gone:
            del self._carried[n]
            self.workers.pop(n, None)
        return gone

    # --- the stream ---------------------------------------------------------------------------

    async def _run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        backoff = Backoff(self.backoff_s, self.backoff_max_s)

        async def connect_and_follow() -> bool:
            agg = await self._resolve()
            ip = await asyncio.to_thread(_node_ip)
            ep = await asyncio.wait_for(agg.endpoints.remote(ip), self.poll_timeout_s)
            sub = ctx.socket(zmq.SUB)
            try:
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, 10_000)
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_DELTA_FRAME_BYTES)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(ep.publish)  # before the snapshot: deltas after it queue up meanwhile
                await self._follow(agg, sub, backoff)
            finally:
                sub.close(linger=0)
            return False

        def lost(exc: Exception) -> None:  # unreachable/restarting aggregator: keep routing on last view
            if self.connected or self.last_error is None:
                logger.warning("aggregator unreachable (%s: %s); routing on last snapshot", type(exc).__name__, exc)
            self.connected = False
            self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"

        await reconnecting(connect_and_follow, backoff, on_error=lost)

    async def _follow(self, agg: Any, sub: zmq.asyncio.Socket, backoff: Backoff) -> None:
        """A full snapshot, then deltas; a new epoch or a missed delta means a snapshot again.
        Deltas are applied from an event-loop callback as they arrive (`SocketWatch`: no future
        per delta); this task fetches snapshots and raises when the stream goes silent (the caller
        re-resolves the aggregator)."""
        raw = zmq.Socket.shadow(sub.underlying)
        resync = asyncio.Event()
        resync.set()
        watch: SocketWatch | None = None

        def drain() -> bool:
            changed: list[str] = []
            more = True
            try:
                for _ in range(_DRAIN_BATCH):
                    # EVENTS before each receive, not receive until zmq.Again: no exception raised
                    # and caught per delta (actors.worker.metrics_pipe.drain_frames says why it matters)
                    if not raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        more = False
                        break
                    try:
                        frame = raw.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        more = False
                        break
                    self._ok(len(frame))
                    try:
                        d = decode_delta(frame)
                    except ProtocolError as exc:
                        logger.warning("aggregator sent an undecodable delta (%s); resyncing", exc)
                        raise _Resync() from None
                    if d.epoch != self.epoch:
                        if d.prev_version != 0 or self.epoch is None:
                            raise _Resync()  # restarted, and we missed the start of its stream
                        # a restarted aggregator's stream from its start (its registry began empty
                        # at version 0): nothing missed, so no snapshot through Ray — whose news
                        # that the actor is alive again reaches this process late under load
                        self.restarts_followed += 1
                    elif d.prev_version > self.version:
                        raise _Resync()  # we missed a delta
                    elif d.version <= self.version:  # a keep-alive, or already in our snapshot
                        if d.heard:
                            self.heard(d.heard)
                        continue
                    changed += self.apply(d)
                    self.updates += 1
            except _Resync:
                assert watch is not None
                watch.pause()  # what follows waits in the socket until the snapshot is applied
                resync.set()
                more = False
            if self._carried:
                changed += self.expire_carried()
            self._changed(changed)
            return more

        try:
            while True:
                if resync.is_set():
                    frame = await asyncio.wait_for(agg.snapshot.remote(), self.poll_timeout_s)
                    self.resyncs += 1
                    self._ok(len(frame))
                    self._changed(self.apply(decode_delta(frame)))
                    backoff.reset()
                    resync.clear()
                    if watch is None:
                        watch = SocketWatch(raw, drain, exhaustive=True)
                    else:
                        watch.kick()
                try:
                    await asyncio.wait_for(resync.wait(), self.silence_s)
                except asyncio.TimeoutError:
                    if self._carried:
                        self._changed(self.expire_carried())
                    if self.last_ok_at is None or time.monotonic() - self.last_ok_at >= self.silence_s:
                        raise TimeoutError(f"no delta or keep-alive from the aggregator in {self.silence_s} s") from None
        finally:
            if watch is not None:
                watch.close()

    def _ok(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.frames_received += 1
        self.connected = True
        self.last_ok_at = time.monotonic()
        self.last_error = None
        self._first.set()

    def _changed(self, changed: list[str]) -> None:
        if changed and self.on_update is not None:
            self.on_update(changed)


def _rank_times(ranks: list[Any], newest_at: float | None) -> dict[int, float]:
    """Each rank's newest frame time (local clock): `newest_at` is the newest rank's; the others are
    older by the difference of their ages in the worker actor's report."""
    if newest_at is None or len(ranks) < 2:
        return {} if newest_at is None else {r.data_parallel_rank: newest_at for r in ranks}
    youngest = min(r.age_s for r in ranks)
    return {r.data_parallel_rank: newest_at - (r.age_s - youngest) for r in ranks}


def _node_ip() -> str | None:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return None
