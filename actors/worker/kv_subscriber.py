"""The KV-event subscription of one engine (no Ray): meet SGLang's publisher as its release decides
(`kv_handshake`), decode batches (`kv_events`), recover lost ones from the replay ROUTER, keep what
the engine holds (`kv_log`) and answer the routers' long polls (`since`).

Hosted by a worker actor (`actors.worker.actor`) or, for a Ray Serve LLM replica, by the replica's
small KV-log actor (`serve_app.ray_llm.kv_log_actor`): the same code either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from actors.fleet import WorkerSpec

from actors.wire.kv_events import (
    KvEventError,
    SeqTracker,
    decode_kv_event_frame,
    is_replay_end,
    replay_reply,
)
from actors.wire.kv_handshake import (
    KvEventsPlan,
    SilenceWatch,
    plan_subscription,
    rank_endpoint,
)
from actors.worker.kv_log import KvLog
from actors.models import Settings
from actors.ports import free_port
from actors.protocol import (
    KvEventsCounters,
    KvEventsStatus,
    KvHandshakeSide,
    KvLogAnswer,
)

logger = logging.getLogger("kvroute.kv_subscriber")


def _bind_ranks(sock: zmq.Socket, host: str, ranks: int, attempts: int = 50) -> int:
    """Bind `sock` on `ranks` consecutive free ports of `host` (a random base; another base when a
    port above it is taken) and return the base."""
    last: zmq.ZMQError | None = None
    for _ in range(attempts):
        base = sock.bind_to_random_port(f"tcp://{host}", max_port=65536 - ranks)
        bound = [base]
        try:
            for r in range(1, ranks):
                sock.bind(f"tcp://{host}:{base + r}")
                bound.append(base + r)
            return base
        except zmq.ZMQError as exc:  # base + r is taken: release what we bound, try another base
            last = exc
            for port in bound:
                sock.unbind(f"tcp://{host}:{port}")
    raise last if last is not None else zmq.ZMQError(zmq.EADDRINUSE)


class SubscribeError(RuntimeError):
    """The KV-event socket cannot be bound or connected (the message names worker and endpoint)."""


class KvSubscriber:
    """SUB socket + KV log of one engine. `endpoint="auto"`: bind a free port on `host` (rank r on
    base + r) and a replay address for the engine to bind — read them back from `endpoint` /
    `replay_endpoint` and give them to the engine (it connects its PUB). Otherwise `plan_subscription`
    decides bind or connect from SGLang's own rule. Construct on the hosting loop; `start()` the
    receive task; `on_change` is called when the subscription's status changes (e.g. to push it)."""

    def __init__(
        self,
        name: str,
        ctx: zmq.asyncio.Context,
        settings: Settings,
        endpoint: str,
        *,
        bind: bool | None = None,
        replay_endpoint: str | None = None,
        ranks: int = 1,
        host: str = "127.0.0.1",
        peer_host: str | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.log = KvLog()
        self._ctx = ctx
        self._on_change = on_change
        self._changed = asyncio.Event()
        self.refused: dict[str, int] = {}
        self._trackers: dict[int, SeqTracker] = {}
        self.batches = 0
        self.replayed = 0
        self._watch = SilenceWatch(settings.kv_events_silence_s)
        self._warned = False
        self._catch_up_at = 0.0
        self._catching_up: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock = sock
        try:
            if endpoint == "auto":  # we bind a port, the engine connects to it
                endpoint = f"tcp://{host}:{_bind_ranks(sock, host, ranks)}"  # rank r publishes on base + r
                # a connecting PUB loses what it sends before our subscription reached it (libzmq applies
                # it at the first send, so batch 0 is always lost): the engine's replay ROUTER, which
                # SGLang always binds (rank r on its base + r), gives those batches back
                replay_endpoint = replay_endpoint or f"tcp://{host}:{free_port(host, count=ranks)}"
                bind = None
                self.plans = [KvEventsPlan(r, "bind", rank_endpoint(endpoint, r), rank_endpoint(replay_endpoint, r))
                              for r in range(ranks)]
            else:
                self.plans = plan_subscription(endpoint, bind=bind, replay_endpoint=replay_endpoint, ranks=ranks,
                                               peer_host=peer_host)
                for plan in self.plans:
                    (sock.bind if plan.side == "bind" else sock.connect)(plan.address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise SubscribeError(f"worker {name}: cannot subscribe to KV events on {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self.bind = bind
        self.replay_endpoint = replay_endpoint
        self.opened_at = time.monotonic()
        for plan in self.plans:
            logger.info("worker %s: KV events %s", name, plan.describe())

    def start(self) -> asyncio.Task:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self._task

    def config(self, topic: str = "kv-events") -> dict[str, Any]:
        """The engine's `--kv-events-config` for an `auto` subscription: a concrete address makes every
        SGLang release (0.4.9 … 0.5.23) CONNECT its PUB there (no `bind` key, no wildcard)."""
        cfg: dict[str, Any] = {"publisher": "zmq", "topic": topic, "endpoint": self.endpoint}
        if self.bind is not None:
            cfg["bind"] = self.bind
        if self.replay_endpoint:
            cfg["replay_endpoint"] = self.replay_endpoint
        return cfg

    # --- status --------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """`waiting` | `ok` | `silent` (see `kv_handshake.SilenceWatch`)."""
        return self._watch.state

    def info(self) -> KvEventsStatus:
        """What /workers shows about the subscription (slow-changing fields only)."""
        return KvEventsStatus(
            status=self._watch.state,
            handshake=[KvHandshakeSide(rank=p.rank, kvroute=p.side, address=p.address) for p in self.plans],
            batches=self.batches,
            detail=self.silence_detail() if self._watch.state == "silent" else "",
        )

    def counters(self) -> KvEventsCounters:
        return KvEventsCounters(
            seq=self.log.seq, blocks=self.log.blocks(), refused=dict(self.refused),
            gaps=sum(t.gaps for t in self._trackers.values()), replayed=self.replayed,
            endpoint=self.endpoint, subscription=self.info())

    def silence_detail(self) -> str:
        sides = {p.side for p in self.plans}
        if sides == {"bind"}:
            cause = ("kvroute binds, so SGLang must CONNECT: its --kv-events-config endpoint must be this concrete "
                     "address with no \"bind\": true, and not a wildcard / ipc:// form (those make SGLang bind)")
        else:
            cause = ("kvroute connects, so SGLang must BIND: give it tcp://*:PORT, ipc://PATH or (SGLang >= 0.5.22) "
                     "\"bind\": true — a plain tcp://HOST:PORT makes SGLang connect, and then both sides connect")
        return (f"no KV-event batch in {self.settings.kv_events_silence_s:.0f} s while KvMetrics show the engine "
                f"holding KV pages; likely a bind/connect mismatch: {cause}")

    def watch(self, busy: bool) -> str:
        """Feed the engine's KvMetrics evidence (`kv_handshake.shows_prefill` of a fresh report) at each
        liveness tick: updates the silence watch (warns once when silent) and, while the engine shows
        prefills but nothing arrived, asks the replay ROUTER for what a connecting PUB dropped."""
        before = self._watch.state
        state = self._watch.observe(time.monotonic(), self.batches, busy)
        if state != before:
            self._on_change()
        if state == "silent" and not self._warned:
            self._warned = True
            logger.warning("worker %s: KV events silent (%s) — %s", self.name,
                           "; ".join(p.describe() for p in self.plans), self.silence_detail())
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = asyncio.get_running_loop().create_task(self._catch_up())
        return state

    # --- the routers' long poll ----------------------------------------------------------------

    async def since(self, epoch: str | None, seq: int, timeout_s: float = 5.0) -> KvLogAnswer:
        """KV events after the cursor (or the whole state when it is from another epoch or too old);
        waits up to `timeout_s` for news when the cursor is current."""
        if epoch == self.log.epoch and seq >= self.log.seq:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.log.since(epoch, seq)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- receive -------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
                if is_replay_end(frames):
                    continue
                try:
                    batch = decode_kv_event_frame(frames)
                except KvEventError as exc:
                    self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
                    continue
                self.batches += 1
                if self._watch.state != "ok":
                    self.watch(False)
                tracker = self._trackers.setdefault(batch.dp_rank, SeqTracker())
                status = tracker.observe(batch.seq)
                if status.kind == "restart":
                    logger.warning("worker %s: KV events restarted at seq %d (rank %d): the engine restarted; "
                                   "dropping that rank's entries", self.name, batch.seq, batch.dp_rank)
                    self.log.lose_rank(batch.dp_rank)
                elif status.kind in ("gap", "first") and batch.seq > 0:
                    start = status.missing_from if status.kind == "gap" else 0
                    if not await self._replay(batch.dp_rank, start, batch.seq) and status.kind == "gap":
                        logger.warning("worker %s: KV events lost batches %d..%d (rank %d) and no replay "
                                       "covered them; dropping that rank's entries",
                                       self.name, status.missing_from, status.missing_to, batch.dp_rank)
                        self.log.lose_rank(batch.dp_rank)
                if status.apply and batch.events:
                    self.log.apply(batch.dp_rank, batch.events)
                self._notify()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker %s: KV event loop error", self.name)
                await asyncio.sleep(0.01)

    async def _catch_up(self) -> None:
        """The engine shows prefills but no batch arrived: ask each rank's replay ROUTER from seq 0.
        Recovers batches a connecting PUB dropped before our subscription reached it (with nothing
        live after them to reveal the gap); if the replay is empty too, the watch stays `silent`."""
        if self.batches or self._watch.busy_since is None or time.monotonic() < self._catch_up_at:
            return
        self._catch_up_at = time.monotonic() + max(1.0, self.settings.kv_events_silence_s / 2)
        for plan in self.plans:
            if plan.replay is not None and plan.rank not in self._trackers:
                await self._replay(plan.rank, 0, None)
        before = self._watch.state
        if self._watch.observe(time.monotonic(), self.batches, False) != before:
            self._on_change()

    async def _replay(self, rank: int, start: int, stop: int | None) -> bool:
        """Ask the rank's replay ROUTER for batches `start`..`stop - 1` (None: all it holds) and apply
        them in order. True only if every one of them arrived (the engine's buffer still held them)."""
        plan = next((p for p in self.plans if p.rank == rank), None)
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
                    self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
                    continue
                if start <= b.seq and (stop is None or b.seq < stop):
                    got[b.seq] = b
        finally:
            dealer.close(linger=0)
        for seq in sorted(got):
            if got[seq].events:
                self.log.apply(rank, got[seq].events)
        self.replayed += len(got)
        if stop is None:  # caught up from nothing: the live stream continues after the newest one
            if got:
                self._trackers.setdefault(rank, SeqTracker()).observe(max(got))
                self.batches += len(got)
                self._notify()
            complete, stop = bool(got), (max(got) + 1 if got else start)
        else:
            complete = len(got) == stop - start
        if got:
            logger.info("worker %s: KV events replayed %d of batches %d..%d (rank %d)",
                        self.name, len(got), start, stop - 1, rank)
        return complete

    async def close(self) -> None:
        """Stop the tasks and close the socket (linger 0). Idempotent."""
        tasks = {t for t in (self._task, self._catching_up) if t is not None}
        for t in tasks:
            t.cancel()
        if tasks:  # bounded: on Python 3.11 a wait_for racing the cancel can swallow it
            await asyncio.wait(tasks, timeout=0.5)
        if not self._sock.closed:
            self._sock.close(linger=0)


def subscribe_for(spec: WorkerSpec, ctx: zmq.asyncio.Context, settings: Any, *, listen_host: str,
                  on_change: Callable[[], None]) -> tuple[KvSubscriber, WorkerSpec]:
    """Meet `spec`'s KV-event publisher, SGLang's own rule (`actors.wire.kv_handshake`): bind the SUB where
    SGLang connects (a concrete tcp address, never a wildcard), connect where SGLang binds. With
    `kv_events_endpoint: auto` (managed) the SUB binds on `listen_host` before the engine starts, and
    the spec returned names the concrete address its engine connects to (and a restarted owner binds
    again). Raises EndpointError."""
    from actors.worker.endpoint import EndpointError

    auto = spec.kv_events_endpoint == "auto"
    peer = spec.url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]") if spec.url else None
    try:
        kv = KvSubscriber(spec.name, ctx, settings, spec.kv_events_endpoint, bind=spec.kv_events_bind,
                          replay_endpoint=spec.kv_events_replay_endpoint, ranks=spec.kv_event_ranks,
                          host=listen_host if auto else "127.0.0.1", peer_host=peer, on_change=on_change)
    except SubscribeError as exc:
        raise EndpointError(str(exc)) from None
    if auto:
        spec = spec.model_copy(update={"kv_events_endpoint": kv.endpoint, "kv_events_bind": None,
                                       "kv_events_replay_endpoint": kv.replay_endpoint})
    return kv, spec
