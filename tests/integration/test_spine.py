"""The spine end to end on one local Ray: SGLang-like emitters → worker actors → aggregator →
router replica (real HTTP through Ray Serve)."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections import Counter

import httpx
import pytest

from actors.fleet import parse_fleet
from tests.integration.emitters import Emitter
from tests.integration.helpers import HealthServer, reregistered, wait_for

pytestmark = pytest.mark.ray

N = 3
PREFIX = "/spine"


@pytest.fixture(scope="module")
def fleet_env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("ipc")
    servers = [HealthServer() for _ in range(N)]
    fleet = parse_fleet(
        {
            "workers": [
                {"name": f"w{i}", "url": s.url, "metrics_endpoint": f"ipc://{tmp}/w{i}.metrics", "page_size": 16}
                for i, s in enumerate(servers)
            ]
        }
    )
    agg = get_or_create_aggregator(fleet.settings)
    ray.get(agg.ping.remote())
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="spine-") for w in fleet.workers}
    ray.get([a.ready.remote() for a in actors.values()])
    emitters = {w.name: Emitter(w.metrics_endpoint, form="0.5.23") for w in fleet.workers}
    serve.run(
        build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False, "router": {"policy": "least_loaded", "seed": 1}}),
        name="spine", route_prefix=PREFIX,
    )
    base = f"http://127.0.0.1:{serve_port}{PREFIX}"
    client = httpx.Client(base_url=base, timeout=10)
    seen: list[str] = []

    def all_there() -> bool:  # (the session's aggregator may hold other modules' workers too)
        seen[:] = [w["name"] for w in client.get("/workers").json()["workers"]]
        return {w.name for w in fleet.workers} <= set(seen)

    try:
        wait_for(all_there, 30, what=f"all {N} workers in /workers")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the router's /workers last named {seen}") from None
    yield {"client": client, "actors": actors, "emitters": emitters, "servers": servers, "fleet": fleet}
    client.close()
    serve.delete("spine")
    for e in emitters.values():
        e.close()
    ray.get([a.stop.remote() for a in actors.values()])
    for a in actors.values():
        ray.kill(a, no_restart=True)
    for s in servers:
        s.close()


def _workers(client) -> dict[str, dict]:
    return {w["name"]: w for w in client.get("/workers").json()["workers"]}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


def test_workers_shows_what_the_schedulers_sent_in_blocks(fleet_env):
    c, em = fleet_env["client"], fleet_env["emitters"]
    em["w0"].send(request_active_slots=5, num_requests_waiting=2, kv_active_blocks=1600, gpu_cache_usage_perc=0.01)
    w = wait_for(lambda: (x := _workers(c)["w0"])["metrics"] and x["metrics"]["request_active_slots"] == 5 and x, 5,
                 what="w0 metrics in /workers")
    assert w["state"] == "live"
    assert w["metrics"]["num_requests_waiting"] == 2
    assert w["metrics"]["kv_active_blocks"] == 100  # 1600 tokens / page 16
    assert w["metrics"]["kv_total_blocks"] == 10_000
    assert w["metrics_age_s"] < 2.0 and w["heartbeat_age_s"] < 2.0
    assert [r["data_parallel_rank"] for r in w["ranks"]] == [0]


def _active(c) -> dict[str, int | None]:
    return {n: (w["metrics"] or {}).get("request_active_slots") for n, w in _workers(c).items()}


def test_route_follows_the_load_within_two_windows(fleet_env):
    c, em, s = fleet_env["client"], fleet_env["emitters"], fleet_env["fleet"].settings
    em["w0"].send(num_requests_waiting=20, request_active_slots=64)
    em["w1"].send(num_requests_waiting=20, request_active_slots=64)
    em["w2"].send(num_requests_waiting=0, request_active_slots=1)
    # all three values in the router's view first (reports of a small fleet come in coalescing
    # windows: a view holding w0 alone has w1 and w2 tied without metrics)
    wait_for(lambda: {k: v for k, v in _active(c).items() if k in ("w0", "w1", "w2")} == {"w0": 64, "w1": 64, "w2": 1},
             5, what="the three loads in /workers")
    picks = {c.post("/route", json=CHAT).json()["worker"] for _ in range(10)}
    assert picks == {"w2"}
    # shift the load: w2 saturates, w1 empties. A change waits at most one window at its worker
    # actor and one at the aggregator (coalesce_s each, the first change after a quiet spell at once)
    bound = 2 * s.coalesce_s + 0.1
    t0 = time.monotonic()
    em["w2"].send(num_requests_waiting=30, request_active_slots=64)
    em["w1"].send(num_requests_waiting=0, request_active_slots=0)
    wait_for(lambda: c.post("/route", json=CHAT).json()["worker"] == "w1", 2, interval_s=0.005, what="route to w1")
    elapsed = time.monotonic() - t0
    assert elapsed < bound, f"load change reached /route after {elapsed * 1000:.0f} ms (bound {bound * 1000:.0f})"
    d = c.post("/route", json=CHAT).json()
    assert d["policy"] == "least_loaded" and d["url"].startswith("http://127.0.0.1:") and d["reason"]


def test_route_rejects_bad_bodies_and_unknown_policies(fleet_env):
    c = fleet_env["client"]
    r = c.post("/route", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = c.post("/route", json=CHAT, headers={"x-kvroute-policy": "nope"})
    assert r.status_code == 400 and "least_loaded" in r.json()["error"]["message"]
    r = c.post("/route", json={"model": "m"})
    assert r.status_code == 400


def test_hostile_frames_are_counted_and_refused_while_valid_values_arrive(fleet_env, tmp_path):
    import ray

    c, em, actors = fleet_env["client"], fleet_env["emitters"], fleet_env["actors"]
    before = ray.get(actors["w1"].stats.remote())
    target = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {target}",))

    hostile = [pickle.dumps(Evil(), protocol=4), b"\x80\x05garbage", b"\x00" * 70_000, pickle.dumps({"a": 1}), b""]
    for i in range(20):
        em["w1"].send_raw(hostile[i % len(hostile)])
        em["w1"].send(request_active_slots=i, num_requests_waiting=0)
    em["w1"].sock.send_multipart([b"part1", b"part2"])
    em["w1"].send(request_active_slots=42)
    wait_for(lambda: _workers(c)["w1"]["metrics"]["request_active_slots"] == 42, 5, what="last valid value")
    after = ray.get(actors["w1"].stats.remote())
    refused = after.frames_refused - before.frames_refused
    assert refused == 21  # 20 hostile frames + 1 multipart message
    assert after.frames_accepted - before.frames_accepted == 21
    assert after.refused_by_reason["forbidden_global"] - before.refused_by_reason.get("forbidden_global", 0) == 4
    assert after.refused_by_reason["oversized"] >= 4
    assert after.refused_by_reason["multipart"] >= 1
    assert not target.exists()


def test_killing_the_aggregator_loses_no_worker_and_route_keeps_answering(fleet_env):
    import ray

    from actors.aggregator.actor import AGGREGATOR_NAME, NAMESPACE

    c = fleet_env["client"]
    assert "epoch" in c.get("/workers").json()  # the router answers before the restart
    answers: list[int] = []
    stop = threading.Event()

    def hammer():
        with httpx.Client(base_url=str(c.base_url), timeout=5) as hc:
            while not stop.is_set():
                answers.append(hc.post("/route", json=CHAT).status_code)
                time.sleep(0.01)

    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(0.2)
    agg = ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE)
    old_epoch = ray.get(agg.ping.remote())
    ray.kill(agg, no_restart=False)
    killed_at = time.monotonic()
    new_epoch = wait_for(lambda: (e := ray.get(agg.ping.remote(), timeout=5)) != old_epoch and e, 20, interval_s=0.01,
                         what="aggregator restarted by Ray")
    restarted_at, restarted_wall = time.monotonic(), time.time()
    # the router notices the new epoch and every worker is back, re-registered by its actor
    names = [f"w{i}" for i in range(N)]
    epoch_seen: list[float] = []  # when the router first followed the new aggregator (for the message)

    def back() -> bool:
        view = c.get("/workers").json()
        if view["epoch"] == new_epoch and not epoch_seen:
            epoch_seen.append(time.monotonic() - restarted_at)
        return reregistered(view, names, new_epoch, restarted_wall)

    wait_for(back, 10, interval_s=0.01, what="all workers back after aggregator restart")
    back_after = time.monotonic() - restarted_at
    total = time.monotonic() - killed_at
    time.sleep(0.2)
    stop.set()
    t.join()
    assert answers and all(code == 200 for code in answers), f"non-200 answers: {set(answers)}"
    # whole again from the next heartbeats (0.5 s each); Ray's own restart of the actor comes first
    assert back_after < 1.0, f"workers back {back_after:.2f} s after the restart (the router on the new epoch " \
                             f"after {epoch_seen[0]:.2f} s)"
    assert total < 5.0, f"workers back {total:.2f} s after the kill"
    h = c.get("/healthz").json()
    assert h["aggregator"] == "reachable"


def test_a_worker_whose_health_fails_goes_down_and_is_not_routed_to(fleet_env):
    c, em, servers = fleet_env["client"], fleet_env["emitters"], fleet_env["servers"]
    for name in ("w0", "w1", "w2"):
        em[name].send(num_requests_waiting=0, request_active_slots=0)
    em["w0"].send(num_requests_waiting=0, request_active_slots=0)
    servers[0].healthy = False
    try:
        wait_for(lambda: _workers(c)["w0"]["state"] == "down", 5, what="w0 down")
        picks = {c.post("/route", json=CHAT).json()["worker"] for _ in range(30)}
        assert "w0" not in picks and picks <= {"w1", "w2"}
    finally:
        servers[0].healthy = True
    wait_for(lambda: _workers(c)["w0"]["state"] != "down", 5, what="w0 back up")


def test_healthz_reports_the_snapshot_age(fleet_env):
    c = fleet_env["client"]
    h = c.get("/healthz").json()
    assert h["status"] == "ok"
    assert h["snapshot_age_s"] is not None and h["snapshot_age_s"] < 10
    # its counts are the router's whole view, which may hold other modules' workers (the session's
    # aggregator is shared): they must agree with /workers, and none of this module's is down
    seen: list = []

    def counts_agree() -> bool:
        listed = c.get("/workers").json()["workers"]
        counts = c.get("/healthz").json()["workers"]
        seen[:] = [counts, [(w["name"], w["state"], w["health_detail"]) for w in listed]]
        return counts == dict(Counter(w["state"] for w in listed))

    wait_for(counts_agree, 3, what="/healthz counts = the states /workers lists")
    ours = {name: state for name, state, _ in seen[1] if name in {f"w{i}" for i in range(N)}}
    assert len(ours) == N and "down" not in ours.values(), f"/healthz {seen[0]}, /workers {seen[1]}"

