"""Per-request routing cost inside a deployment handle: kvroute's `KvRouteRequestRouter` vs Ray Serve
LLM's `PrefixCacheAffinityRouter`, the same calls Serve makes (`choose_replicas`, then
`on_request_routed`, then `on_request_completed`), timed in one process on a private local Ray.

    python -m serve_app.ray_llm.routing_cost [--replicas 4] [--requests 400] [--prefixes 8]

Both routers get the same replicas (placeholder actors under Serve replica names: neither router
calls them on the request path here — queue lengths come from Serve's cache, filled as a handle fills
it; a background probe gets 0) and the
same chat prompts (`--prefixes` shared system prompts, distinct questions). kvroute's router follows
a real aggregator to which the replicas report KvMetrics through the metrics plane; the prefix
router calls its prefix-tree actor with a blocking `ray.get` per request, as shipped. Prints the
figures (p50 / p99 / mean µs per request) and the machine's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from types import SimpleNamespace
from typing import Any


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _register(names: list[str]) -> Any:
    """Report each replica to the aggregator as a live worker (what KvrouteSGLangServer's collector does)."""
    from actors.aggregator.actor import get_or_create_aggregator
    from actors.transport.link import AggregatorLink
    from actors.protocol import RankMetrics, WorkerReport

    link = AggregatorLink(lambda: asyncio.to_thread(get_or_create_aggregator))
    while not await link.ensure():
        await asyncio.sleep(0.1)
    ranks = [RankMetrics(request_active_slots=2, request_total_slots=256, kv_active_blocks=100, kv_total_blocks=25_000,
                         num_requests_waiting=0, gpu_cache_usage_perc=0.004, gpu_prefix_cache_hit_rate=0.0,
                         data_parallel_rank=0)]
    link.push_reports([WorkerReport(name=n, url="", page_size=16, incarnation="cost", healthy=True, ranks=ranks)
                       for n in names])
    return link


async def _run(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    import ray
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RunningReplicaInfo
    from ray.serve._private.request_router.common import PendingRequest
    from ray.serve._private.request_router.replica_wrapper import RunningReplica
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve._private.common import RequestMetadata

    from serve_app.ray_llm.names import replica_worker_name
    from serve_app.ray_llm.request_router import KvRouteRequestRouter
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor

    @ray.remote(num_cpus=0)
    class Placeholder:
        def ping(self) -> None:
            return None

        def get_num_ongoing_requests(self, *args: Any, **kwargs: Any) -> int:  # Serve's queue-length probe
            return 0

    dep = DeploymentID(name="SGLangServer:m", app_name="cost")
    infos, actors = [], []
    for i in range(ns.replicas):
        rid = ReplicaID(unique_id=f"r{i}{uuid.uuid4().hex[:6]}", deployment_id=dep)
        actor_name = f"SERVE_REPLICA::cost#{dep.name}#{rid.unique_id}"
        actors.append(Placeholder.options(name=actor_name, namespace=SERVE_NAMESPACE).remote())
        infos.append(RunningReplicaInfo(replica_id=rid, node_id=None, node_ip=None, availability_zone=None,
                                        actor_name=actor_name, max_ongoing_requests=1_000_000))
    ray.get([a.ping.remote() for a in actors])
    link = await _register([replica_worker_name(info.replica_id) for info in infos])

    common = dict(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True,
                  create_replica_wrapper_func=lambda r: RunningReplica(r))
    kv = KvRouteRequestRouter(**common)
    kv.initialize_state(policy="kv_aware", ray_metrics=False)
    prefix = PrefixCacheAffinityRouter(**common)
    prefix.initialize_state(tree_actor=PrefixTreeActor.options(name=f"cost-tree-{uuid.uuid4().hex[:6]}").remote())
    routers = {"kvroute KvRouteRequestRouter (kv_aware)": kv, "Ray PrefixCacheAffinityRouter": prefix}
    if ns.tokenizer != "none":  # exact mode's extra per-request work: the chat rendered and tokenized like the engine
        exact = KvRouteRequestRouter(**common)
        exact.initialize_state(policy="kv_aware", ray_metrics=False, tokenizer=ns.tokenizer)
        routers = {**routers, f"kvroute KvRouteRequestRouter (kv_aware, tokenizer {ns.tokenizer})": exact}
    for r in routers.values():
        r._update_running_replicas(infos)
        for info in infos:
            r.on_new_queue_len_info(info.replica_id, 0)
    deadline = time.monotonic() + 30
    kvs = [r for r in routers.values() if isinstance(r, KvRouteRequestRouter)]
    while any(len(r.follower.workers) < ns.replicas for r in kvs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for r in kvs:
        if len(r.follower.workers) < ns.replicas:
            raise RuntimeError(f"kvroute's router sees {len(r.follower.workers)} of {ns.replicas} replicas after 30 s")

    systems = [f"System prompt {p}: " + " ".join(f"rule {p}.{k} applies" for k in range(200)) for p in range(ns.prefixes)]
    results: dict[str, dict[str, float]] = {}
    for label, router in routers.items():
        times: list[float] = []
        picks: dict[str, int] = {}
        for i in range(ns.requests + ns.warmup):
            msgs = [{"role": "system", "content": systems[i % ns.prefixes]},
                    {"role": "user", "content": f"question {i}"}]
            body = SimpleNamespace(messages=msgs, prompt=None, max_tokens=16)
            meta = RequestMetadata(request_id=f"q{i}", internal_request_id=f"q{i}-{uuid.uuid4().hex[:6]}",
                                   call_method="chat")
            pr = PendingRequest(args=[body, None], kwargs={}, metadata=meta)
            t0 = time.perf_counter()
            ranks = await router.choose_replicas(router._replicas_list, pr)
            chosen = next(rank for rank in ranks if rank)[0]
            router.on_request_routed(pr, chosen.replica_id, None)
            router.on_request_completed(chosen.replica_id, meta.internal_request_id)
            dt = time.perf_counter() - t0
            if i >= ns.warmup:
                times.append(dt)
                picks[chosen.replica_id.unique_id] = picks.get(chosen.replica_id.unique_id, 0) + 1
        results[label] = {"p50_us": _percentile(times, 0.5) * 1e6, "p99_us": _percentile(times, 0.99) * 1e6,
                          "mean_us": statistics.fmean(times) * 1e6, "replicas_used": len(picks)}
    link.close()
    for r in kvs:
        await r.follower.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--tokenizer", default="none",
                    help="also time kvroute in exact prefix mode with this tokenizer (sim | hf:<dir>): the "
                         "per-request cost of rendering and tokenizing the chat like the engine")
    ns = ap.parse_args()
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, namespace="kvroute", include_dashboard=False, log_to_driver=False)
    try:
        results = asyncio.run(_run(ns))
    finally:
        ray.shutdown()
    print(f"per-request routing cost in the handle ({ns.replicas} replicas, {ns.requests} requests, "
          f"{ns.prefixes} shared prefixes); load average {open('/proc/loadavg').read().split()[:3]}")
    for label, r in results.items():
        print(f"  {label:45s} p50 {r['p50_us']:8.0f} µs   p99 {r['p99_us']:8.0f} µs   mean {r['mean_us']:8.0f} µs"
              f"   replicas used {r['replicas_used']}")


if __name__ == "__main__":
    main()
