"""One metrics host per Ray node: a single async Ray actor hosting the workers placed on its node —
each worker's metrics PULL, /health probe and model discovery, and the engine process of each
managed one — and pushing one batched `HostFrame` per coalescing window to the aggregator, which
is also the heartbeat of all of them (liveness O(nodes), one Ray process floor per node instead of
one per worker).

The host role itself is `actors.hosting.NodeHosting`, written once: the aggregator runs the same
class for the workers on its own node (no host process there, frames into its registry in-process),
so a `MetricsHost` exists only on the other nodes. `start_worker` picks: the aggregator's node → the
aggregator; another node → that node's `MetricsHost`. Either owns the engines of the managed workers
it hosts, each under a keeper (`actors.keeper`) that lets it outlive its owner's restart by
`Settings.engine_adopt_grace_s`: the restarted actor adopts it (no engine restart, no model reload).

Which workers are hosted (`hostable`): every managed worker and every attach-mode one without Ray
resources, with their KV events too (the host subscribes and serves each worker's KV log to the
routers' `kv_since(…, worker=name)`). A managed worker's `num_gpus` / `num_cpus` / `resources` are
held by a placement group (`actors.reservation`), which also picks its node; its engine gets the
group's GPUs as `CUDA_VISIBLE_DEVICES`.

The host is named per node (`kvroute-metrics-host-<node id>`), detached, pinned to its node,
get-or-create. It remembers its workers' specs in Ray's internal KV, so Ray restarting it
(`max_restarts=-1`) brings its workers back; `stop_hosting()` forgets them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
import zmq.asyncio
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.fleet import WorkerSpec
from actors.hosting import HostingCalls, LocalLink, NodeHosting, hostable, needs_reservation, remember, remembered  # noqa: F401 (re-exported)
from actors.link import AggregatorLink
from actors.models import NAMESPACE, Settings

logger = logging.getLogger("kvroute.host")

# routers long-poll hosted KV logs: no task-event bookkeeping per poll (as WorkerActor.kv_since)
ray.method(enable_task_events=False)(HostingCalls.kv_since)
HOST_PREFIX = "kvroute-metrics-host-"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class MetricsHost(HostingCalls):
    """The metrics of every hosted worker on this node (`HostingCalls`: methods address a worker by name)."""

    def __init__(self, host: str, settings: dict[str, Any] | None = None) -> None:
        self.host = host
        self.settings = s = Settings.model_validate(settings or {})
        self._ctx = zmq.asyncio.Context()
        self._link = AggregatorLink(self._resolve_aggregator, ctx=self._ctx, hwm=s.max_pending_pushes,
                                    backoff_s=s.reconnect_backoff_s, backoff_max_s=s.reconnect_backoff_max_s,
                                    follow_window=True)  # the aggregator's fleet-wide window (actors.fleet_window)
        node = ray.get_runtime_context().get_node_id()
        key = f"{host}-workers"
        from actors.reservation import release
        from actors.worker_actor import listen_host

        self._hosting = NodeHosting(host, node, s, self._ctx, self._link, deregister=self._deregister,
                                    remember=lambda specs: remember(key, node, specs), engines=True,
                                    listen_host=listen_host, release=release)
        self._hosting.restore(remembered(key)[1])  # Ray restarted us: the same workers, their engines adopted
        self._hosting.start()
        logger.info("metrics host %s up (%d workers)", host, len(self._hosting.workers))

    async def stop_hosting(self, deregister: bool = False) -> None:
        await self._hosting.stop(deregister=deregister)
        self._link.close()
        self._ctx.term()

    async def _deregister(self, name: str) -> Any:
        if self._link.handle is not None:
            return await self._link.handle.remove.remote(name)

    async def _resolve_aggregator(self) -> Any:
        from actors.aggregator import get_or_create_aggregator

        return await asyncio.to_thread(get_or_create_aggregator, self.settings)


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
    (`.remote()` each), all calls on the actor hosting it (its node's metrics host, or the
    aggregator) naming the worker."""

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
        return _Bound(self.host.worker_stats, self.name)

    @property
    def stop(self) -> _Bound:
        return _Bound(self.host.remove_worker, self.name)


def start_hosted_worker(spec: WorkerSpec, settings: Settings, prefix: str = HOST_PREFIX,
                        env: dict[str, str] | None = None) -> HostedWorker:
    """Host `spec` in its node's `MetricsHost` (`spec.node_id`, else this process's node); `env`: its
    managed engine's environment."""
    host = get_or_create_host(spec.node_id, settings, prefix)
    return HostedWorker(host, spec.name, host.add_worker.remote(spec.model_dump(mode="json"), None, env))


def start_in_aggregator(spec: WorkerSpec, settings: Settings, env: dict[str, str] | None = None) -> HostedWorker:
    """Host `spec` in the aggregator (it must be placed on the aggregator's node)."""
    from actors.aggregator import get_or_create_aggregator

    agg = get_or_create_aggregator(settings)
    return HostedWorker(agg, spec.name, agg.add_worker.remote(spec.model_dump(mode="json"), None, env))


def list_hosts(prefix: str = HOST_PREFIX) -> list[str]:
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, NAMESPACE)
        if ns == NAMESPACE and name.startswith(prefix):
            out.append(name)
    return out


def remove_hosted(names: list[str] | None = None, prefix: str = HOST_PREFIX, deregister: bool = True,
                  aggregator: bool | None = None) -> list[str]:
    """Stop hosting `names` on every metrics host and (`aggregator`; default: with the default
    `prefix`) in the aggregator (None: every worker, and kill the metrics hosts). Returns the names
    of the workers that were hosted."""
    if aggregator is None:
        aggregator = prefix == HOST_PREFIX
    removed: list[str] = []
    hosts: list[tuple[str, Any, bool]] = []
    for hname in list_hosts(prefix):
        try:
            hosts.append((hname, ray.get_actor(hname, namespace=NAMESPACE), True))
        except ValueError:  # gone meanwhile
            pass
    if aggregator:
        from actors.aggregator import AGGREGATOR_NAME

        try:
            hosts.append((AGGREGATOR_NAME, ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE), False))
        except ValueError:
            pass
    for hname, host, kill in hosts:
        try:
            hosted = ray.get(host.hosted_workers.remote(), timeout=10)
            if names is None:
                try:
                    ray.get(host.stop_hosting.remote(deregister=deregister), timeout=10)
                except Exception:
                    pass
                if kill:
                    ray.kill(host, no_restart=True)
                removed += hosted
                continue
            for n in hosted:
                if n in names and ray.get(host.remove_worker.remote(n, deregister), timeout=10):
                    removed.append(n)
        except Exception as exc:  # a host that died meanwhile
            logger.warning("metrics host %s: %s", hname, exc)
    return removed


def start_worker(spec: WorkerSpec, settings: Settings, *, detached: bool = False, get_if_exists: bool = False) -> Any:
    """The worker's metrics plane as `settings.metrics_hosting` says: when hostable, the aggregator if
    the worker is on the aggregator's node, else that node's metrics host (either owns a managed
    worker's engine; the Ray resources it asks for are reserved first, which places it); else its
    own `WorkerActor`. Returns a handle with `ready`/`stats`/`stop`. Raises ReservationError if its
    resources cannot be reserved within `settings.reserve_timeout_s`."""
    from actors.aggregator import get_or_create_aggregator
    from actors.worker_actor import start_worker_actor

    if settings.metrics_hosting == "node" and hostable(spec):
        env: dict[str, str] = {}
        if spec.managed and needs_reservation(spec):  # a placement group holds them; Ray picks the node
            from actors.reservation import reserve

            held = reserve(spec, settings.reserve_timeout_s)
            spec, env = spec.model_copy(update={"node_id": held.node_id}), held.env()
        node = spec.node_id or ray.get_runtime_context().get_node_id()
        agg_node = ray.get(get_or_create_aggregator(settings).node_id.remote(), timeout=60)
        if node == agg_node:
            return start_in_aggregator(spec, settings, env)
        return start_hosted_worker(spec, settings, env=env)
    return start_worker_actor(spec, settings, detached=detached, get_if_exists=get_if_exists)


def orphans_key(node_id: str, prefix: str = HOST_PREFIX) -> str:
    """Where an aggregator restarted away from dead node `node_id` leaves that node's workers for
    `rehome_orphans`."""
    return f"{prefix}{node_id[:16]}-left-workers"


def rehome_orphans(settings: Settings, prefix: str = HOST_PREFIX) -> list[str]:
    """Re-host the managed workers whose host's node died (what Ray's restart of a worker actor did):
    one whose Ray resources a placement group holds goes where Ray rescheduled that group (the
    engine is launched there); one without goes to the caller's node unless its spec pins a node.
    Others on a dead node (attach mode, pinned) died with it: their memory is dropped. Returns the
    names re-hosted. Blocking (Ray calls); the aggregator runs it in a thread every few seconds."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

    from actors.hosting import split_memory

    keys = [k.decode() for k in _internal_kv_list(prefix.encode(), namespace=NAMESPACE)]
    keys = [k for k in keys if k.endswith("-workers")]
    if not keys:
        return []
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    moved: list[str] = []
    for key in keys:
        node, entries = remembered(key)
        if node is None or node in alive:
            continue
        left, here = [], []
        for entry in entries:
            try:
                spec, _, _ = split_memory(entry)
            except Exception:
                continue
            if not spec.managed:  # attach mode: its server went with the node
                continue
            if not needs_reservation(spec) and spec.node_id:
                logger.warning("worker %s is pinned to node %s, which is gone: not re-hosted", spec.name, node)
                continue
            try:  # its group (if any) decides where; it waits until Ray has rescheduled it
                start_worker(spec.model_copy(update={"node_id": None}), settings)
                here.append(spec.name)
            except Exception as exc:
                logger.warning("worker %s (its node %s is gone) cannot be re-hosted yet: %s", spec.name, node, exc)
                left.append(entry)
        if left:
            remember(key, node, left)
        else:
            _internal_kv_del(key.encode(), namespace=NAMESPACE)
        if here:
            logger.warning("node %s is gone: workers %s re-hosted", node, here)
        moved += here
    return moved


def stop_workers(names: list[str] | None = None) -> list[str]:
    """Stop kvroute's workers, wherever hosted (all, or `names`): their actors stopped and killed,
    hosted ones removed from their metrics hosts and the aggregator (all: the metrics hosts killed
    too). Returns the names."""
    from actors.reservation import release, release_all
    from actors.worker_actor import kill_worker_actors

    stopped = kill_worker_actors(names=names) + remove_hosted(names)
    for name in names or []:  # a host that died meanwhile did not release them
        release(name)
    if names is None:
        release_all()
    return stopped
