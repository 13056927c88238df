"""The KV-event handshake with simulated engines that bind or connect as their SGLang release does:
a mismatch is reported (actor stats, /workers, /metrics, log), a wildcard publisher is connected to,
and a subscriber that starts late rebuilds the engine's cache from its replay ROUTER (0.5.14 form)."""

from __future__ import annotations

import httpx
import pytest

from actors.fleet import parse_fleet
from actors.protocol import KvHandshakeSide
from sim.config import SimConfig
from sim.launch import SimProcess, free_port
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray
PREFIX = "/handshake"
PROMPT = "a handshake probe about kites over the harbour " * 20


def _chat(url: str, text: str = PROMPT) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={"model": "m", "max_tokens": 30, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("handshake")
    # attach mode: a 0.5.14 engine that BINDS its PUB on a wildcard (tcp://*:P) and offers replay
    kv_port, replay_port, http_port = free_port(), free_port(), free_port()
    sim = SimProcess(SimConfig(port=http_port, wire="0.5.14", time_scale=0.2,
                               metrics_endpoint=f"ipc://{tmp}/late.metrics",
                               kv_events_endpoint=f"tcp://*:{kv_port}",
                               kv_events_replay_endpoint=f"tcp://*:{replay_port}")).start()
    _chat(sim.url)  # before any subscriber exists: only the replay buffer can tell about this prompt
    mismatch_port = free_port()
    fleet = parse_fleet({
        "settings": {"kv_events_silence_s": 1.0},
        "workers": [
            # SGLang 0.5.20 drops "bind": it CONNECTS to the concrete address; kvroute, told bind: true, connects too
            {"name": "mismatch", "engine": "sim", "page_size": 16, "metrics_endpoint": f"ipc://{tmp}/mm.metrics",
             "kv_events_endpoint": f"tcp://127.0.0.1:{mismatch_port}", "kv_events_bind": True,
             "engine_args": {"wire": "0.5.20", "time_scale": 0.2}},
            {"name": "late", "url": sim.url, "page_size": 16, "metrics_endpoint": f"ipc://{tmp}/late.metrics",
             "kv_events_endpoint": f"tcp://*:{kv_port}", "kv_events_replay_endpoint": f"tcp://*:{replay_port}"},
        ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="hs-") for w in fleet.workers}
    infos = {n: ray.get(a.ready.remote(), timeout=120) for n, a in actors.items()}
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False,
                         "router": {"policy": "kv_aware", "tokenizer": "sim", "block_size": 16}}),
              name="handshake", route_prefix=PREFIX)
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}", timeout=30)
    yield {"client": client, "actors": actors, "infos": infos, "sim": sim}
    client.close()
    serve.delete("handshake")
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)
    sim.stop()


def test_both_sides_connecting_is_reported_as_silent_with_the_likely_cause(env):
    import ray

    c, actors, infos = env["client"], env["actors"], env["infos"]
    _chat(infos["mismatch"].url)  # the engine now holds pages and says so in KvMetrics
    stats = wait_for(lambda: (s := ray.get(actors["mismatch"].stats.remote())).kv_events.subscription.status == "silent"
                     and s, 15, what="mismatch flagged silent")
    assert stats.kv_events.subscription.batches == 0 and stats.kv_events.subscription.handshake[0].kvroute == "connect"
    assert "bind/connect mismatch" in stats.kv_events.subscription.detail
    row = wait_for(lambda: next(w for w in c.get("/workers").json()["workers"] if w["name"] == "mismatch")
                   ["managed"]["kv_events"]["status"] == "silent", 10, what="/workers shows silent")
    assert row
    metrics = c.get("/metrics").text
    assert 'kvroute_worker_kv_events_silent{worker="mismatch"} 1.0' in metrics
    assert 'kvroute_worker_kv_events_silent{worker="late"} 0.0' in metrics


def test_a_late_subscriber_replays_what_the_engine_cached_before_it_existed(env):
    import ray

    actors, infos = env["actors"], env["infos"]
    _chat(infos["late"].url, "a second prompt that is live, not replayed " * 10)
    stats = wait_for(lambda: (s := ray.get(actors["late"].stats.remote())).kv_events.replayed > 0 and s, 15,
                     what="replay of batches published before the actor subscribed")
    port = env['sim'].config.kv_events_endpoint.rsplit(':', 1)[1]
    assert stats.kv_events.subscription.handshake[0] == KvHandshakeSide(rank=0, kvroute="connect",
                                                                        address=f"tcp://127.0.0.1:{port}")
    assert stats.kv_events.subscription.status == "ok" and stats.kv_events.refused == {}
    # the first prompt (cached before the actor existed) routes by exact overlap to 'late'
    model = env["sim"].config.model_name  # what 'late' serves (its /v1/models): the request must name it
    d = wait_for(lambda: (x := env["client"].post("/route", json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}).json())["worker"] == "late"
        and "overlap=" in x["reason"] and x, 10, what="route by replayed blocks")
    assert int(d["reason"].split("overlap=")[1].split("/")[0]) >= 10
