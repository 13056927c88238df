"""Multi-node scenario, run as its own process (it needs its own Ray: a head + two worker nodes).

Prints one JSON line with what it observed; tests/integration/test_multinode.py asserts on it.
"""

from __future__ import annotations

import json
import sys
import time


import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from actors.aggregator.actor import AGGREGATOR_NAME, get_or_create_aggregator  # noqa: E402
from actors.models import NAMESPACE  # noqa: E402
from actors.fleet import parse_fleet  # noqa: E402
from actors.worker.actor import start_worker  # noqa: E402
from serve_app.app import build_app  # noqa: E402
from serve_app.ray_env import apply_serve_env  # noqa: E402


def _gpu_env(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    v = env.get(b"CUDA_VISIBLE_DEVICES")
    return None if v is None else v.decode()


def wait(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            v = pred()
            if v:
                return v
        except Exception:
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> None:
    port = int(sys.argv[1])
    out: dict = {}
    apply_serve_env()  # kvroute's Serve transport, as `kvroute serve` sets it for a local Ray
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"kvroute_head": 100}})
    gpu_a = cluster.add_node(num_cpus=2, num_gpus=1, resources={"sglang_slot": 1})
    gpu_b = cluster.add_node(num_cpus=2, num_gpus=1, resources={"sglang_slot": 1})
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        head_id = ray.get_runtime_context().get_node_id()
        out["nodes"] = {"head": head_id, "a": gpu_a.node_id, "b": gpu_b.node_id}
        fleet = parse_fleet({
            "settings": {"aggregator_resources": {"kvroute_head": 1}},
            "workers": [{"name": "gpu", "engine": "sim", "replicas": 2, "host": "127.0.0.1", "page_size": 16,
                         "num_gpus": 1, "resources": {"sglang_slot": 1},
                         "engine_args": {"time_scale": 0.2}}],
        })
        agg = get_or_create_aggregator(fleet.settings)
        ray.get(agg.ping.remote())
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        # kvroute serve's path: each worker's actor holds its GPU (Ray places it and sets
        # CUDA_VISIBLE_DEVICES) and owns its engine
        actors = {w.name: start_worker(w, fleet.settings) for w in fleet.expanded()}
        infos = {n: ray.get(a.ready.remote(), timeout=120) for n, a in actors.items()}
        out["workers"] = {n: {"node": i.node_id, "endpoint": i.metrics_endpoint, "env": _gpu_env(i.managed.pid)}
                          for n, i in infos.items()}
        serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False,
                             "replica_resources": {"kvroute_head": 1}}), name="mn", route_prefix="/")
        actors_state = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        out["aggregator_node"] = next(a.node_id for a in actors_state if a.name == AGGREGATOR_NAME)
        out["worker_actors"] = sorted((a.name, a.node_id) for a in actors_state if a.class_name == "WorkerActor")
        out["router_nodes"] = sorted({a.node_id for a in actors_state if "KvRouter" in (a.class_name or "") or
                                      (a.name or "").startswith("SERVE_REPLICA::mn#KvRouter")})
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        wait(lambda: sum(w["state"] != "down" for w in c.get("/workers").json()["workers"]) == 2, 30, "workers up")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        served = [c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": f"q{i} " * 40}]},
                         headers={"x-kvroute-policy": "round_robin"}) for i in range(6)]
        out["before"] = {"codes": [r.status_code for r in served],
                         "workers": sorted({r.headers.get("x-kvroute-worker") for r in served})}
        victim = next(n for n, i in infos.items() if i.node_id == gpu_a.node_id)
        cluster.remove_node(gpu_a)
        killed = time.monotonic()
        wait(lambda: {w["name"]: w for w in c.get("/workers").json()["workers"]}[victim]["state"] == "down", 20,
             "victim down")
        out["down_after_s"] = time.monotonic() - killed
        after = [c.post("/v1/chat/completions", json=body) for _ in range(6)]
        out["after"] = {"codes": [r.status_code for r in after],
                        "workers": sorted({r.headers.get("x-kvroute-worker") for r in after})}
        out["victim"] = victim
        # a new GPU node: Ray restarts the dead node's worker actor there (its GPU is what it waited
        # for), and the restarted actor launches its engine again
        gpu_c = cluster.add_node(num_cpus=2, num_gpus=1, resources={"sglang_slot": 1})
        out["nodes"]["c"] = gpu_c.node_id
        added = time.monotonic()
        wait(lambda: {w["name"]: w for w in c.get("/workers").json()["workers"]}[victim]["state"] != "down", 120,
             "victim restarted")
        out["rehomed_after_s"] = time.monotonic() - added
        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        out["rehomed_actor_nodes"] = sorted(a.node_id for a in alive if a.name == f"kvroute-worker-{victim}")
        again = [c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": f"r{i} " * 40}]},
                        headers={"x-kvroute-policy": "round_robin"}) for i in range(6)]
        out["rehomed"] = {"codes": [r.status_code for r in again],
                          "workers": sorted({r.headers.get("x-kvroute-worker") for r in again})}
    finally:
        print("RESULT " + json.dumps(out), flush=True)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
