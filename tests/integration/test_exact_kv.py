"""Exact prefix mode end to end: simulated engines publish SGLang KV events, their actors
subscribe, router replicas follow, and overlap comes from what the engines really hold."""

from __future__ import annotations

import httpx
import pytest

from actors.fleet import parse_fleet
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray
PREFIX = "/exact"


# the sim's KV-event side follows its --wire release: 0.5.23 sends tagged maps, 0.5.14 tagged arrays, and
# both CONNECT their PUB to the concrete address kvroute bound (kv_events_endpoint: auto); each worker's
# actor subscribes and serves its KV log to the routers
@pytest.fixture(scope="module", params=["0.5.23", "0.5.14"])
def env(request, ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    wire = request.param
    enc = wire.replace(".", "")
    tmp = tmp_path_factory.mktemp(f"exact-{enc}")
    fleet = parse_fleet({"workers": [
        {"name": f"k{i}", "engine": "sim", "page_size": 16, "metrics_endpoint": f"ipc://{tmp}/k{i}.metrics",
         "kv_events_endpoint": "auto",
         "engine_args": {"time_scale": 0.2, "wire": wire, "max_total_num_tokens": 65536}}
        for i in range(2)
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix=f"exact-{enc}-") for w in fleet.workers}
    infos = {n: ray.get(a.ready.remote(), timeout=120) for n, a in actors.items()}
    app = f"exact{enc}"
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False,
                         "router": {"policy": "kv_aware", "tokenizer": "sim", "block_size": 16, "seed": 5}}),
              name=app, route_prefix=f"{PREFIX}-{enc}")
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}-{enc}", timeout=60)
    wait_for(lambda: sum(w["state"] != "down" for w in client.get("/workers").json()["workers"]) == 2, 30,
             what="workers up")
    yield {"client": client, "actors": actors, "infos": infos}
    client.close()
    serve.delete(app)
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)


def _body(text: str) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


def _overlap(decision: dict) -> int:
    reason = decision["reason"]
    return int(reason.split("overlap=")[1].split("/")[0]) if "overlap=" in reason else 0


def test_overlap_comes_from_what_the_engine_holds_not_what_the_router_sent(env):
    import ray

    c, infos, actors = env["client"], env["infos"], env["actors"]
    prompt = "an exact prefix routing probe about tulips and windmills " * 30
    # sent straight to k1, bypassing the router: only k1's KV events can tell the router about it
    r = httpx.post(f"{infos['k1'].url}/v1/chat/completions", json=_body(prompt), timeout=30)
    assert r.status_code == 200
    stats = wait_for(lambda: (s := ray.get(actors["k1"].stats.remote())).kv_events.blocks > 10 and s, 10,
                     what="k1's actor holding the engine's blocks")
    assert stats.kv_events.refused == {}
    d = wait_for(lambda: (x := c.post("/route", json=_body(prompt)).json())["worker"] == "k1" and _overlap(x) and x,
                 10, what="route to k1 by exact overlap")
    assert _overlap(d) >= 20  # the ~24-block prompt's blocks are cached on k1, and the router knows it
    # the engine drops its cache → AllBlocksCleared → the router stops claiming affinity
    assert httpx.post(f"{infos['k1'].url}/flush_cache", timeout=10).status_code == 200
    wait_for(lambda: _overlap(c.post("/route", json=_body(prompt)).json()) == 0, 10,
             what="affinity gone after the engine's cache was flushed")
    assert ray.get(actors["k1"].stats.remote()).kv_events.blocks == 0


def test_workers_table_reports_kv_event_followers(env):
    import ray

    stats = ray.get(env["actors"]["k0"].stats.remote())
    assert stats.kv_events is not None and stats.kv_events.gaps == 0
    [hs] = stats.kv_events.subscription.handshake
    assert hs.kvroute == "bind" and hs.address == stats.kv_events.endpoint
    rows = {w["name"]: w for w in env["client"].get("/workers").json()["workers"]}
    assert rows["k1"]["managed"]["kv_events"]["status"] in ("ok", "waiting")
