"""The singleton aggregator actor: soft state filled by reports pushed over ZeroMQ, published to
router replicas as coalesced deltas over ZeroMQ PUB/SUB.

Ray carries only lifecycle: creating and restarting the actor, handing out its `Endpoints`
(addresses + token), full snapshots for followers that start or resync, and removals. The hot
path never makes a Ray call: worker actors and router replicas PUSH msgspec frames to its PULL
(`actors.protocol`), and it publishes at most one delta per `publish_interval_s`.

Exposure: both sockets bind a concrete address, never a wildcard — loopback while every Ray node
is this machine, else this node's Ray IP (the cluster's private interface). Every pushed frame must
carry the aggregator's token (128 random bits, handed out only through Ray's authenticated actor
calls, kept across restarts) and decode as exactly one typed message; anything else is counted and
dropped. The PUB stream carries the fleet view (worker URLs and load), no secrets.

It also hosts the workers placed on its own node (`actors.hosting.NodeHosting`, the same class a
node's `MetricsHost` runs): their SGLang PULLs, /health probes and one batched frame per window,
handed to the registry in-process (`LocalLink`) — no host process and no ZeroMQ hop on the
aggregator's node — and the engines of the managed ones (each under a keeper, `actors.keeper`).
Their specs, and where their engines are, are remembered in Ray's internal KV: Ray restarting the
aggregator re-binds them in the new incarnation and adopts the engines, which kept running (their
frames in between are lost; the newest after the re-bind is what counts). If it restarts on another
node (its node died), it does not host them there — an ipc endpoint is node-local: they go to their
node's `MetricsHost` if that node is alive, else the managed ones to the orphan sweep (hosted again
where Ray reschedules their resources) and the rest died with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections import Counter
from typing import Any

import ray
import zmq
import zmq.asyncio

from actors.fleet_window import FleetWindow
from actors.hosting import ENGINE_KEY, ENV_KEY, HostingCalls, LocalLink, NodeHosting, remember, remembered
from actors.models import NAMESPACE, Settings
from actors.protocol import (
    MAX_INGEST_FRAME_BYTES, AggregatorStats, Endpoints, HostFrame, InFlightShare, ProtocolError, decode_ingest,
    encode_delta,
)
from actors.registry import FleetRegistry, publish_wait_s

logger = logging.getLogger("kvroute.aggregator")

AGGREGATOR_NAME = "kvroute-aggregator"
_PORTS_KEY = b"kvroute-aggregator-ports"  # Ray internal KV: where the last incarnation listened
_DRAIN_BATCH = 4096
# routers long-poll hosted KV logs: no task-event bookkeeping per poll (as WorkerActor.kv_since)
ray.method(enable_task_events=False)(HostingCalls.kv_since)
_HOSTED_KEY = "kvroute-aggregator-workers"  # Ray internal KV: the workers it hosts for its node


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


def _cluster_is_this_machine(ip: str) -> bool:
    try:
        return {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")} <= {ip}
    except Exception:
        return False


def _token_id(token: str) -> str:
    """Which aggregator a saved entry belongs to, without storing its token."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def _remembered_ports(token: str) -> dict[str, list[int]]:
    """The ports the previous incarnation of *this* aggregator listened on (same token: Ray
    restarted it). A new aggregator (another token) takes new ports, so links of the old one see
    their connection drop and ask Ray again — else they would push frames with a stale token."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(_PORTS_KEY, namespace=NAMESPACE)
        saved = json.loads(raw) if raw else {}
        return saved.get("ports", {}) if saved.get("token") == _token_id(token) else {}
    except Exception:
        return {}


def _remember_ports(token: str, ports: dict[str, list[int]]) -> None:
    try:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(_PORTS_KEY, json.dumps({"token": _token_id(token), "ports": ports}).encode(), overwrite=True,
                         namespace=NAMESPACE)
    except Exception:
        logger.warning("could not remember the aggregator's ports; a restart will pick new ones")


def _bind(sock: zmq.Socket, host: str, port: int | None) -> int:
    """Bind `host`, on `port` if given and free (a restart keeps its address), else a random port."""
    if port:
        try:
            sock.bind(f"tcp://{host}:{port}")
            return port
        except zmq.ZMQError:
            pass
    return sock.bind_to_random_port(f"tcp://{host}")


# max_task_retries=-1: calls made while Ray restarts it wait for the new incarnation instead of
# failing (every method is idempotent), so snapshots and endpoint look-ups resume when it is back.
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Aggregator(HostingCalls):
    """Named, detached, restartable. Holds only soft state: after a restart (same token, same ports
    when free) the workers' next reports (≤ `heartbeat_s`) make it whole, and the new epoch in the
    published deltas tells routers to resync. Hosts its own node's workers (`HostingCalls`)."""

    def __init__(self, settings: dict[str, Any] | None = None, token: str | None = None) -> None:
        self.settings = Settings.model_validate(settings or {})
        self._registry = FleetRegistry(self.settings)
        self._token = token or secrets.token_hex(16)
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 10_000)  # a bounded backlog is a bounded staleness: senders drop, newest wins
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_INGEST_FRAME_BYTES)  # larger peers are dropped by ZMQ
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 1000)  # a follower this far behind is dropped from, then resyncs
        self._pub_raw = zmq.Socket.shadow(self._pub.underlying)
        self._ip = _node_ip()
        self._ports = _remembered_ports(self._token)
        self._bound: dict[str, tuple[str, str]] = {}
        self._listen("127.0.0.1" if _cluster_is_this_machine(self._ip) else self._ip)
        self._pending = False  # the registry changed since the last published delta
        self.reports = 0
        self.shares = 0
        self.host_frames = 0
        self.refused: Counter = Counter()
        self.published = 0
        self.published_bytes = 0
        self._last_pub = 0.0
        self._flush: asyncio.TimerHandle | None = None
        self._window = FleetWindow(self.settings, time.monotonic())
        self._window_changed = asyncio.Event()  # set (and replaced) when the fleet-wide window changes
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop())
        self._host_own_node()
        self._orphans = loop.create_task(self._orphan_sweep())
        logger.info("aggregator up, epoch %s, listening on %s", self._registry.epoch, self._bound)

    def _host_own_node(self) -> None:
        """Host this node's workers in-process; after a restart, the ones remembered (see the module
        docstring for a restart on another node)."""
        node = ray.get_runtime_context().get_node_id()
        self._local_link = LocalLink(self._local_frame)
        from actors.reservation import release
        from actors.worker_actor import listen_host

        self._hosting = NodeHosting(AGGREGATOR_NAME, node, self.settings, self._ctx, self._local_link,
                                    deregister=self.remove, remember=lambda specs: remember(_HOSTED_KEY, node, specs),
                                    engines=True, listen_host=listen_host, release=release)
        was_on, specs = remembered(_HOSTED_KEY)
        if specs and was_on not in (None, node):
            self._hand_off(was_on, specs)
            specs = []
            remember(_HOSTED_KEY, node, [])
        self._hosting.restore(specs)  # their engines adopted
        self._hosting.start()

    def _hand_off(self, node: str, specs: list[dict[str, Any]]) -> None:
        """Restarted on another node: `specs` were hosted on `node`; its own metrics host takes them if
        `node` is alive (created pinned to it), else they died with it."""
        try:
            alive = any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())
        except Exception:
            alive = False
        names = [s.get("name") for s in specs]
        if not alive:  # managed ones are re-hosted elsewhere by the orphan sweep; the rest went with it
            from actors.metrics_host import orphans_key

            remember(orphans_key(node), node, specs)
            logger.warning("restarted away from node %s, which is gone: its workers %s go to the orphan sweep", node,
                           names)
            return
        from actors.metrics_host import get_or_create_host

        host = get_or_create_host(node, self.settings)
        for entry in specs:
            entry = dict(entry)
            engine, env = entry.pop(ENGINE_KEY, None), entry.pop(ENV_KEY, None)  # that host adopts its engine
            host.add_worker.remote(entry, engine, env)  # not awaited: the new host reports them as soon as it binds
        logger.warning("restarted away from node %s: its workers %s handed to that node's metrics host", node, names)

    # --- this node's hosted workers: frames in-process ------------------------------------------

    def _local_frame(self, host: str, incarnation: str, workers: list[str], reports: list[Any]) -> None:
        """A frame of the hosted workers (the pipe's `LocalLink`): applied at once, published as soon
        as `publish_interval_s` allows — the host's window was the coalescing, so no second wait."""
        self.host_frames += 1
        self.reports += len(reports)
        self._observe_window(time.monotonic())
        if self._registry.host_frame(host, incarnation, workers, reports, local=True):
            self._pending = True
            self._publish_soon()

    # --- the fleet-wide window (actors.fleet_window) ---------------------------------------------

    def _observe_window(self, now: float) -> None:
        if self._window.observe(self.reports, now):
            w = self._window.window_s
            logger.info("fleet %s (%.0f reports/s): metrics hosts coalesce over %.3f s", "large" if self._window.large
                        else "small", self._window.rate, w)
            self._local_link.window_s = w
            self._window_changed.set()
            self._window_changed = asyncio.Event()

    async def host_window(self, known: float | None = None, wait_s: float = 30.0) -> float:
        """The coalescing window metrics hosts use now (`actors.fleet_window`). A long-poll: answers at
        once if it differs from `known`, else when it changes or after `wait_s`."""
        if known == self._window.window_s:
            try:
                await asyncio.wait_for(self._window_changed.wait(), timeout=min(max(wait_s, 0.0), 300.0))
            except asyncio.TimeoutError:
                pass
        return self._window.window_s

    def _publish_soon(self) -> None:
        if self._flush is not None:
            return
        wait = self.settings.publish_interval_s - (time.monotonic() - self._last_pub)
        if wait <= 0:
            self._publish_pending()
        else:
            self._flush = asyncio.get_running_loop().call_later(wait, self._publish_pending)

    def _publish_pending(self) -> None:
        self._flush = None
        if self._pending:
            self._publish(self._registry.take_delta() or self._registry.keepalive())
            self._pending, self._last_pub = False, time.monotonic()

    def _listen(self, host: str) -> tuple[str, str]:
        if host not in self._bound:
            old = self._ports.get(host, [None, None])
            ports = [_bind(self._pull, host, old[0]), _bind(self._pub, host, old[1])]
            self._bound[host] = (f"tcp://{host}:{ports[0]}", f"tcp://{host}:{ports[1]}")
            self._ports[host] = ports
            _remember_ports(self._token, self._ports)
        return self._bound[host]

    # --- lifecycle (Ray calls) ----------------------------------------------------------------

    async def endpoints(self, client_ip: str | None = None) -> Endpoints:
        """Where to push reports and follow deltas from `client_ip`'s node: loopback for this
        machine, this node's IP otherwise (bound on first need)."""
        remote = "127.0.0.1" in self._bound and client_ip not in (None, self._ip, "127.0.0.1")
        host = self._ip if remote else next(iter(self._bound))
        ingest, publish = self._listen(host)
        return Endpoints(epoch=self._registry.epoch, ingest=ingest, publish=publish, token=self._token)

    async def snapshot(self) -> bytes:
        """The whole fleet as an encoded `FleetDelta` (full): a follower's start and resync."""
        return encode_delta(self._registry.snapshot())

    async def remove(self, name: str) -> bool:
        removed = self._registry.remove(name)
        if removed:
            logger.info("worker %s removed", name)
            self._pending = True
        return removed

    async def names(self) -> list[str]:
        return self._registry.names()

    async def ping(self) -> str:
        return self._registry.epoch

    async def stats(self) -> AggregatorStats:
        """Counters for benchmarks and diagnosis."""
        return AggregatorStats(pid=os.getpid(), epoch=self._registry.epoch, workers=len(self._registry),
                               version=self._registry.version, reports=self.reports, in_flight_shares=self.shares,
                               refused=dict(self.refused), published=self.published,
                               published_bytes=self.published_bytes, endpoints=dict(self._bound),
                               hosts=self._registry.hosts(), host_frames=self.host_frames,
                               host_window_s=self._window.window_s, late_reports=self._registry.late_reports)

    # --- hot path (ZeroMQ) --------------------------------------------------------------------

    async def _orphan_sweep(self) -> None:
        """Every `orphan_sweep_s`: re-host the managed workers whose node died with their host
        (`actors.metrics_host.rehome_orphans`, in a thread: it waits on Ray)."""
        from actors.metrics_host import rehome_orphans

        while True:
            await asyncio.sleep(self.settings.orphan_sweep_s)
            try:
                await asyncio.to_thread(rehome_orphans, self.settings)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("orphan sweep failed")

    async def _loop(self) -> None:
        """One loop for ingest, publication and time-driven states, so the event loop wakes at most
        once per `publish_interval_s` under load (frames gather in the socket meanwhile) and, when
        nothing arrives, when a frame does or when something is due (a state threshold, the
        keep-alive after `heartbeat_s` without a delta: `state_tick_s` ≤ the wait ≤ `heartbeat_s`).
        Each wake-up: drain the PULL, re-derive states when due, publish one delta of every worker
        changed since the last (or a keep-alive). The workers it hosts itself publish from their
        frames (`_local_frame`), not through this loop."""
        s, reg, sock = self.settings, self._registry, self._pull
        raw = zmq.Socket.shadow(sock.underlying)  # sync view of the same socket for cheap drains
        token = self._token.encode()
        last_tick = last_drain = 0.0
        while True:
            try:
                drained = self._drain(raw, reg, token)
                busy = self._pending  # these frames changed something (not heartbeats alone)
                now = time.monotonic()
                self._observe_window(now)
                wait = publish_wait_s(s, drained, now - last_drain, busy or self._pending)
                last_drain = now
                if now - last_tick >= s.state_tick_s:
                    self._pending |= reg.tick()
                    last_tick = now
                if self._pending and now - self._last_pub >= s.publish_interval_s:
                    self._publish(reg.take_delta() or reg.keepalive())
                    self._pending, self._last_pub = False, now
                elif now - self._last_pub >= s.heartbeat_s:
                    self._publish(reg.keepalive())
                    self._last_pub = now
                if drained or self._pending:  # frames gather in the socket meanwhile
                    await asyncio.sleep(wait)
                else:  # quiet: sleep until a frame arrives or something is due
                    until = min(reg.next_due(), self._last_pub + s.heartbeat_s) - time.monotonic()
                    await sock.poll(timeout=1000 * min(max(until, s.state_tick_s), s.heartbeat_s), flags=zmq.POLLIN)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must never die
                logger.exception("aggregator loop error")
                await asyncio.sleep(0.01)

    def _drain(self, raw: zmq.Socket, reg: FleetRegistry, token: bytes) -> int:
        """Apply every frame waiting (up to a bound); refuse and count anything not ours."""
        n = 0
        for n in range(1, _DRAIN_BATCH + 1):
            try:
                frame = raw.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return n - 1
            if raw.getsockopt(zmq.RCVMORE):
                while raw.getsockopt(zmq.RCVMORE):
                    raw.recv(zmq.NOBLOCK)
                self.refused["multipart"] += 1
                continue
            try:
                msg = decode_ingest(frame)
            except ProtocolError:
                self.refused["malformed"] += 1
                continue
            if not hmac.compare_digest(msg.token.encode(), token):
                self.refused["token"] += 1
                continue
            if isinstance(msg, InFlightShare):
                self.shares += 1
                self._pending |= reg.report_in_flight(msg.replica, msg.counts)
                continue
            if isinstance(msg, HostFrame):
                self.host_frames += 1
                self.reports += len(msg.reports)
                self._pending |= reg.host_frame(msg.host, msg.incarnation, msg.workers, msg.reports)
                continue
            for r in msg.reports:
                self.reports += 1
                self._pending |= reg.report(r)
        return n

    def _publish(self, delta: Any) -> None:
        frame = encode_delta(delta)
        try:
            self._pub_raw.send(frame, zmq.NOBLOCK)  # the sync view: no asyncio send future per delta
        except zmq.Again:
            pass
        self.published += 1
        self.published_bytes += len(frame)


def aggregator_options(settings: Settings, resources: dict[str, float] | None = None) -> dict[str, Any]:
    return {
        "name": AGGREGATOR_NAME,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "resources": resources if resources is not None else dict(settings.aggregator_resources),
    }


def get_or_create_aggregator(
    settings: Settings | None = None, resources: dict[str, float] | None = None
) -> Any:
    """The singleton's handle, creating it if absent (idempotent across callers; the first
    creator's token is kept, Ray restarts the actor with it). Blocking call: from an async actor
    run it in a thread (`asyncio.to_thread`)."""
    settings = settings or Settings()
    return Aggregator.options(**aggregator_options(settings, resources)).remote(
        settings.model_dump(), secrets.token_hex(16))


def kill_aggregator() -> bool:
    """Tear the detached singleton down (it outlives Serve otherwise). True if one existed."""
    try:
        handle = ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True
