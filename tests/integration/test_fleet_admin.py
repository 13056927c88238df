"""Workers added and removed while the router runs (admin routes guarded by the admin key)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray
ADMIN = "admin-key-for-tests"
API = "api-key-for-tests"


@pytest.fixture(scope="module")
def client(ray_cluster, serve_port):
    from ray import serve

    from actors.worker.actor import stop_workers
    from serve_app.app import build_app

    serve.run(build_app({"fleet": None, "router": {"admin_key": ADMIN, "api_key": API}}), name="admin",
              route_prefix="/admin-app")
    c = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}/admin-app", timeout=120,
                     headers={"authorization": f"Bearer {API}"})
    yield c
    c.close()
    serve.delete("admin")
    stop_workers(names=["added-0"])


def test_fleet_changes_need_the_admin_key(client):
    r = client.post("/admin/workers", json={"name": "x", "engine": "sim"})
    assert r.status_code == 401  # the API key is not the admin key
    r = client.delete("/admin/workers/x", headers={"authorization": "Bearer wrong-key-123"})
    assert r.status_code == 401


def test_an_invalid_worker_is_refused_naming_the_field(client):
    r = client.post("/admin/workers", json={"name": "bad", "engine": "sim", "page_size": 0},
                    headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and "page_size" in r.json()["error"]["message"]


def test_add_route_remove_without_restarting_the_router(client, tmp_path):
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert client.get("/workers").json()["workers"] == []
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 503
    r = client.post("/admin/workers", headers=admin, json={"workers": [
        {"name": "added", "engine": "sim", "replicas": 1, "metrics_endpoint": f"ipc://{tmp_path}/added.metrics",
         "engine_args": {"time_scale": 0.2}}]})
    assert r.status_code == 200, r.text
    assert [a["name"] for a in r.json()["added"]] == ["added"]
    wait_for(lambda: [w["state"] for w in client.get("/workers").json()["workers"]] in (["idle"], ["live"]), 10,
             what="added worker routable")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] == "added"
    dup = client.post("/admin/workers", headers=admin, json={"name": "added", "engine": "sim"})
    assert dup.status_code == 409
    r = client.delete("/admin/workers/added", headers=admin)
    assert r.status_code == 200
    wait_for(lambda: client.get("/workers").json()["workers"] == [], 10, what="worker gone")
    assert client.delete("/admin/workers/added", headers=admin).status_code == 404


def test_an_attach_worker_added_at_run_time_gets_its_own_actor_which_removal_stops(client, tmp_path):
    import ray

    from actors.worker.actor import WORKER_ACTOR_PREFIX, stop_workers
    from actors.models import NAMESPACE
    from tests.integration.helpers import HealthServer

    admin = {"authorization": f"Bearer {ADMIN}"}
    server = HealthServer()
    try:
        r = client.post("/admin/workers", headers=admin, json={"workers": [
            {"name": "hosted-added", "url": server.url, "metrics_endpoint": f"ipc://{tmp_path}/hosted.metrics"}]})
        assert r.status_code == 200, r.text
        wait_for(lambda: [w["state"] for w in client.get("/workers").json()["workers"]] == ["idle"], 10,
                 what="the added worker in the router's view")
        actor = ray.get_actor(f"{WORKER_ACTOR_PREFIX}hosted-added", namespace=NAMESPACE)  # detached, named
        assert ray.get(actor.stats.remote(), timeout=10).name == "hosted-added"
        assert client.delete("/admin/workers/hosted-added", headers=admin).status_code == 200
        wait_for(lambda: client.get("/workers").json()["workers"] == [], 10, what="worker gone")
        with pytest.raises(ValueError):
            ray.get_actor(f"{WORKER_ACTOR_PREFIX}hosted-added", namespace=NAMESPACE)
    finally:
        stop_workers(names=["hosted-added"])
        server.close()
