"""DP-attention ranks through the real router (issue 19, items 2 and 5): a managed sim and an
attach-mode sim, each with --dp-size 2 behind one HTTP server; every forwarded request pins the rank
the router chose, and the sim's own per-rank counters show that rank served it."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from actors.fleet import parse_fleet
from sim.config import SimConfig
from sim.launch import SimProcess, free_port
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray
PREFIX = "/dp-ranks"
NAMES = {"dp-m0", "dp-a0"}


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("dp-ranks")
    attached = SimProcess(SimConfig(port=free_port(), model_name="m", time_scale=0.05, wire="0.5.14", dp_size=2,
                                    metrics_endpoint=f"ipc://{tmp}/a.metrics")).start()
    fleet = parse_fleet({"workers": [
        {"name": "dp-m0", "engine": "sim", "model": "m", "page_size": 16, "dp_size": 2,
         "metrics_endpoint": f"ipc://{tmp}/m.metrics", "engine_args": {"time_scale": 0.05}},
        {"name": "dp-a0", "url": attached.url, "metrics_endpoint": attached.config.metrics_endpoint,
         "page_size": 16, "dp_size": 2, "served_model_names": ["m"]},
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="dp-") for w in fleet.workers}
    ray.get([a.ready.remote() for a in actors.values()], timeout=120)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "router": {"policy": "kv_aware", "seed": 3}}),
              name="dp-ranks", route_prefix=PREFIX)
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}", timeout=60)

    def up() -> dict:
        return {w["name"]: w for w in client.get("/workers").json()["workers"]
                if w["name"] in NAMES and w["state"] != "down"}

    wait_for(lambda: len(up()) == 2 and all(w["dp_size"] == 2 for w in up().values()), 60,
             what="both DP workers up with dp_size 2")
    yield {"client": client, "urls": {n: w["url"] for n, w in up().items()}, "up": up}
    client.close()
    serve.delete("dp-ranks")
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)
    attached.stop()
    agg = get_or_create_aggregator(fleet.settings)  # later modules expect an empty shared fleet
    ray.get([agg.remove.remote(n) for n in NAMES], timeout=30)


def served_by_rank(urls: dict[str, str]) -> Counter:
    """Requests each (worker, rank) finished, from the sims' own per-rank counters."""
    out: Counter = Counter()
    for name, url in urls.items():
        for r in httpx.get(f"{url}/sim/stats", timeout=10).json()["ranks"]:
            out[(name, r["dp_rank"])] = r["requests_finished_total"]
    return out


def test_every_request_is_served_by_the_rank_the_router_chose(env):
    c, urls = env["client"], env["urls"]
    before = served_by_rank(urls)
    chosen: Counter = Counter()
    for i in range(12):
        for policy in ("kv_aware", "round_robin", "least_loaded"):
            body = {"model": "m", "max_tokens": 3, "stream": i % 2 == 1,
                    "messages": [{"role": "system", "content": f"system {i % 3} " * 60},
                                 {"role": "user", "content": f"question {i}"}]}
            # a client's own rank header would override the body on SGLang 0.5.x: the router drops it
            r = c.post("/v1/chat/completions", json=body, headers={"x-kvroute-policy": policy,
                                                                   "X-Data-Parallel-Rank": "1"})
            assert r.status_code == 200, r.text
            chosen[(r.headers["x-kvroute-worker"], int(r.headers["x-kvroute-rank"]))] += 1
    for i in range(6):  # /generate: SGLang's own meta_info.dp_rank names the rank that served it
        r = c.post("/generate", json={"model": "m", "text": f"prompt {i} " * 30, "routed_dp_rank": 1,
                                      "sampling_params": {"max_new_tokens": 2}}, headers={"x-kvroute-policy": "round_robin"})
        assert r.status_code == 200, r.text
        rank = int(r.headers["x-kvroute-rank"])
        assert r.json()["meta_info"]["dp_rank"] == rank
        chosen[(r.headers["x-kvroute-worker"], rank)] += 1
    wait_for(lambda: served_by_rank(urls) - before == chosen, 10, what="the sims' per-rank counts")
    assert len(chosen) == 4, chosen  # round_robin alone reaches all four (worker, rank) targets


def test_route_names_the_rank_and_workers_lists_every_rank(env):
    c = env["client"]
    d = c.post("/route", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert d["worker"] in NAMES and d["rank"] in (0, 1)
    wait_for(lambda: all(sorted(r["data_parallel_rank"] for r in w["ranks"]) == [0, 1] for w in env["up"]().values()),
             20, what="both ranks of both workers reporting KvMetrics")
    for w in env["up"]().values():
        assert len(w["in_flight_by_rank"]) == 2


@pytest.fixture(scope="module")
def exact_env(ray_cluster, serve_port, tmp_path_factory):
    """One managed sim with --dp-size 2 publishing KV events (rank r on the actor's port + r), behind a
    router in exact prefix mode."""
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("dp-exact")
    fleet = parse_fleet({"workers": [
        {"name": "dpx0", "engine": "sim", "page_size": 16, "dp_size": 2, "kv_events_endpoint": "auto",
         "metrics_endpoint": f"ipc://{tmp}/x.metrics", "engine_args": {"time_scale": 0.2, "max_total_num_tokens": 65536}},
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="dpx-") for w in fleet.workers}
    infos = {n: ray.get(a.ready.remote(), timeout=120) for n, a in actors.items()}
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False,
                         "router": {"policy": "kv_aware", "tokenizer": "sim", "block_size": 16, "seed": 5}}),
              name="dp-exact", route_prefix="/dp-exact")
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}/dp-exact", timeout=60)
    wait_for(lambda: any(w["name"] == "dpx0" and w["state"] != "down" for w in client.get("/workers").json()["workers"]),
             30, what="dpx0 up")
    yield {"client": client, "url": infos["dpx0"].url}
    client.close()
    serve.delete("dp-exact")
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)
    agg = get_or_create_aggregator(fleet.settings)
    ray.get([agg.remove.remote("dpx0")], timeout=30)


def _overlap(decision: dict) -> int:
    reason = decision["reason"]
    return int(reason.split("overlap=")[1].split("/")[0]) if "overlap=" in reason else 0


@pytest.mark.parametrize("rank", [1, 0])
def test_kv_events_make_the_rank_that_cached_a_prefix_its_target(exact_env, rank):
    c, url = exact_env["client"], exact_env["url"]
    prompt = f"a DP rank probe number {rank} about herons and lighthouses " * 30
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}
    # straight to the engine, pinned: only that rank's KV events can tell the router where it is cached
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "routed_dp_rank": rank}, timeout=30)
    assert r.status_code == 200, r.text
    d = wait_for(lambda: (x := c.post("/route", json=body).json())["rank"] == rank and _overlap(x) >= 20 and x, 15,
                 what=f"the router routing to rank {rank} by exact overlap")
    assert d["worker"] == "dpx0"
