"""A two-model fleet (plus one attach-mode worker whose model comes from its /v1/models) through
the real router: each request reaches only its model's workers; unknown model → 404."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from actors.fleet import parse_fleet
from sim.config import SimConfig
from sim.launch import SimProcess, free_port
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray
PREFIX = "/multi-model"
A, B = {"mm-a0", "mm-a1"}, {"mm-b0"}


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("multi-model")
    attached = SimProcess(SimConfig(port=free_port(), model_name="model-C", time_scale=0.05,
                                    metrics_endpoint=f"ipc://{tmp}/c.metrics")).start()
    sim = {"engine": "sim", "page_size": 16, "engine_args": {"time_scale": 0.05}}
    fleet = parse_fleet({"workers": [
        *[{"name": n, "model": "model-A", "metrics_endpoint": f"ipc://{tmp}/{n}.metrics", **sim} for n in sorted(A)],
        {"name": "mm-b0", "model": "model-B", "served_model_names": ["model-B", "b-alias"],
         "metrics_endpoint": f"ipc://{tmp}/b0.metrics", **sim},
        # attach mode, no served_model_names: the worker actor asks its /v1/models
        {"name": "mm-c0", "url": attached.url, "metrics_endpoint": attached.config.metrics_endpoint, "page_size": 16},
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="mm-") for w in fleet.workers}
    ray.get([a.ready.remote() for a in actors.values()], timeout=120)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "router": {"policy": "kv_aware", "seed": 5}}),
              name="multi-model", route_prefix=PREFIX)
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}", timeout=60)
    mine = {w.name for w in fleet.workers}
    wait_for(lambda: {w["name"]: w["models"] for w in client.get("/workers").json()["workers"]
                      if w["name"] in mine and w["state"] != "down"}.get("mm-c0") == ["model-C"]
             and sum(w["state"] != "down" for w in client.get("/workers").json()["workers"] if w["name"] in mine) == 4,
             60, what="all four workers up, mm-c0's model learnt from its /v1/models")
    yield {"client": client}
    client.close()
    serve.delete("multi-model")
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)
    attached.stop()
    # the actors deregister best effort (0.5 s); modules after this one expect an empty shared fleet
    agg = get_or_create_aggregator(fleet.settings)
    ray.get([agg.remove.remote(n) for n in mine], timeout=30)


def chat(model: str, content: str) -> dict:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "system", "content": "shared system " * 80},
                                                          {"role": "user", "content": content}]}


def test_each_request_reaches_only_its_models_workers(env):
    c = env["client"]
    seen: dict[str, Counter] = {m: Counter() for m in ("model-A", "model-B", "b-alias", "model-C")}
    for i in range(8):
        for model in seen:  # the same prompts for every model: prefix affinity must not cross models
            for policy in ("kv_aware", "round_robin"):
                r = c.post("/v1/chat/completions", json=chat(model, f"question {i}"),
                           headers={"x-kvroute-policy": policy})
                assert r.status_code == 200, r.text
                seen[model][r.headers["x-kvroute-worker"]] += 1
    assert set(seen["model-A"]) == A, seen  # both A workers used (round_robin), never another
    assert set(seen["model-B"]) == B and set(seen["b-alias"]) == B, seen
    assert set(seen["model-C"]) == {"mm-c0"}, seen
    d = c.post("/route", json=chat("b-alias", "where?")).json()
    assert d["worker"] == "mm-b0" and d["model"] == "b-alias" and d["models"] == ["model-B", "b-alias"]
    # the route receipt: every candidate the policy saw (only the model's workers), with its inputs' ages
    assert {c["target"] for c in d["candidates"]} == {"mm-b0"} and d["adapter"] is None
    assert d["candidates"][0]["ages_s"]["metrics"] is None or d["candidates"][0]["ages_s"]["metrics"] >= 0


def test_an_unknown_model_is_a_404_model_not_found_and_v1_models_lists_the_fleet(env):
    c = env["client"]
    r = c.post("/v1/chat/completions", json=chat("model-Z", "hi"))
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "model-Z" in err["message"]
    assert all(m in err["message"] for m in ("model-A", "model-B", "b-alias", "model-C"))
    r = c.post("/v1/chat/completions", json={k: v for k, v in chat("x", "hi").items() if k != "model"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"
    listed = c.get("/v1/models").json()
    assert listed["object"] == "list"
    ids = {m["id"] for m in listed["data"]}
    assert {"model-A", "model-B", "b-alias", "model-C"} <= ids
