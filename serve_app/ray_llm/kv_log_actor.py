"""The KV log of one Ray Serve LLM replica (exact prefix mode): a small Ray actor on the replica's
node that subscribes to its engine's KV events and answers the request routers' long polls.

Why an actor and not the replica's collector: routers follow a KV log with `kv_since` calls on a
named Ray actor (`serve_app.kv_follower`, the same follower as kvroute's own router replicas), and a
Serve replica cannot be called that way — its actor runs Serve's request protocol, not user
methods. So the replica starts this actor (owned by the replica: Ray kills it when the replica
dies, and the replica kills it on a graceful stop) and names it in its worker record
(`kv_events_actor`), as worker actors name themselves. The actor binds the SUB itself on a
loopback port and the engine's PUB connects there: no KV-event batch crosses the replica's request
loop or a Ray call; the only traffic is the routers' long polls and the collector's one status call
per heartbeat (`watch`), which brings the KvMetrics evidence the silence watch and the replay
catch-up need. Everything it runs is `actors.worker.kv_subscriber.KvSubscriber`, the worker actor's code.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
import zmq.asyncio

from actors.worker.kv_subscriber import KvSubscriber
from actors.models import NAMESPACE, Settings
from actors.protocol import KvEventsCounters, KvEventsStatus, KvLogAnswer

logger = logging.getLogger("kvroute.ray_llm.kv_log")

KV_LOG_ACTOR_PREFIX = "kvroute-kvlog-"


def kv_log_actor_name(worker: str) -> str:
    """The actor's name (in kvroute's namespace) for the replica registered as `worker`."""
    return f"{KV_LOG_ACTOR_PREFIX}{worker}"


@ray.remote(num_cpus=0, max_restarts=0)
class ReplicaKvLog:
    """`ReplicaKvLog(worker, settings, ranks)`: an `auto` KV-event subscription on 127.0.0.1.
    `endpoints()` → the engine's `kv_events_config` (it connects its PUB there)."""

    def __init__(self, worker: str, settings: dict[str, Any] | None = None, ranks: int = 1) -> None:
        self.worker = worker
        self._ctx = zmq.asyncio.Context()
        self.kv = KvSubscriber(worker, self._ctx, Settings.model_validate(settings or {}), "auto", ranks=ranks,
                               host="127.0.0.1")
        self.kv.start()

    def kv_events_config(self) -> dict[str, Any]:
        """The `--kv-events-config` the engine needs (a concrete loopback address: SGLang connects)."""
        return self.kv.config()

    @ray.method(enable_task_events=False)  # a long poll per router: no task-event bookkeeping
    async def kv_since(self, epoch: str | None, seq: int, timeout_s: float = 5.0,
                       worker: str | None = None) -> KvLogAnswer:
        """The routers' long poll (`serve_app.kv_follower`), as `WorkerActor.kv_since` answers it
        (`worker` names the replica's worker; this actor holds that one log)."""
        return await self.kv.since(epoch, seq, timeout_s)

    @ray.method(enable_task_events=False)
    def watch(self, busy: bool) -> KvEventsStatus:
        """The collector's heartbeat: KvMetrics evidence in (`busy`), the subscription's status out."""
        self.kv.watch(busy)
        return self.kv.info()

    def stats(self) -> KvEventsCounters:
        return self.kv.counters()

    async def stop(self) -> None:
        await self.kv.close()
        self._ctx.term()


def start_kv_log_actor(worker: str, settings: Settings, ranks: int = 1) -> Any:
    """Create the replica's KV-log actor on this node (loopback: the engine runs here), owned by the
    calling replica (not detached: it dies with it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return ReplicaKvLog.options(
        name=kv_log_actor_name(worker), namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(worker, settings.model_dump(), ranks)


async def stop_kv_log_actor(handle: Any) -> None:
    """Graceful stop then kill (best effort, ≤ ~1 s): routers see the actor gone and drop the replica."""
    try:
        await asyncio.wait_for(handle.stop.remote(), timeout=1.0)
    except Exception:  # already dead or stuck: the kill below is what matters
        logger.debug("KV-log actor stop failed", exc_info=True)
    try:
        ray.kill(handle, no_restart=True)
    except Exception:
        logger.debug("KV-log actor kill failed", exc_info=True)
