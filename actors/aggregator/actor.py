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

It hosts no worker: every worker's metrics come from that worker's own actor
(`actors.worker.actor`), wherever Ray placed it.
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

from actors.models import NAMESPACE, Settings
from actors.protocol import (
    MAX_INGEST_FRAME_BYTES, AggregatorStats, Endpoints, InFlightShare, ProtocolError, decode_ingest,
    encode_delta,
)
from actors.aggregator.registry import FleetRegistry, publish_wait_s

logger = logging.getLogger("kvroute.aggregator")

AGGREGATOR_NAME = "kvroute-aggregator"
_PORTS_KEY = b"kvroute-aggregator-ports"  # Ray internal KV: where the last incarnation listened
_DRAIN_BATCH = 4096


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
class Aggregator:
    """Named, detached, restartable. Holds only soft state: after a restart (same token, same ports
    when free) the workers' next reports (≤ `heartbeat_s`) make it whole, and the new epoch in the
    published deltas tells routers to resync."""

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
        self.refused: Counter = Counter()
        self.published = 0
        self.published_bytes = 0
        self._last_pub = 0.0
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop())
        logger.info("aggregator up, epoch %s, listening on %s", self._registry.epoch, self._bound)

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
                               late_reports=self._registry.late_reports)

    # --- hot path (ZeroMQ) --------------------------------------------------------------------

    async def _loop(self) -> None:
        """One loop for ingest, publication and time-driven states, so the event loop wakes at most
        once per `publish_interval_s` under load (frames gather in the socket meanwhile) and, when
        nothing arrives, when a frame does or when something is due (a state threshold, the
        keep-alive after `heartbeat_s` without a delta: `state_tick_s` ≤ the wait ≤ `heartbeat_s`).
        Each wake-up: drain the PULL, re-derive states when due, publish one delta of every worker
        changed since the last (or a keep-alive)."""
        s, reg, sock = self.settings, self._registry, self._pull
        raw = zmq.Socket.shadow(sock.underlying)  # sync view of the same socket for cheap drains
        token = self._token.encode()
        last_tick = last_drain = 0.0
        while True:
            try:
                drained = self._drain(raw, reg, token)
                busy = self._pending  # these frames changed something (not heartbeats alone)
                now = time.monotonic()
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
