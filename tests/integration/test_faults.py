"""Fault injection under steady load (streaming and not) through the router to simulated workers.

Each test asserts the numbers: failed requests, time to recover, who served what.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import httpx
import pytest

from actors.fleet import parse_fleet
from tests.integration.helpers import reregistered, wait_for

pytestmark = pytest.mark.ray
PREFIX = "/faults"
N = 3


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("faults")
    fleet = parse_fleet({"workers": [
        {"name": f"f{i}", "engine": "sim", "page_size": 16, "metrics_endpoint": f"ipc://{tmp}/f{i}.metrics",
         "engine_args": {"time_scale": 0.25, "max_running_requests": 64}} for i in range(N)
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="faults-") for w in fleet.workers}
    ray.get([a.ready.remote() for a in actors.values()], timeout=120)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False,
                         "router": {"num_replicas": 2, "upstream_read_timeout_s": 30, "breaker": {"open_s": 2}}}),
              name="faults", route_prefix=PREFIX)
    base = f"http://127.0.0.1:{serve_port}{PREFIX}"
    client = httpx.Client(base_url=base, timeout=60)
    names = [w.name for w in fleet.workers]  # (the session's aggregator may hold other modules' workers too)
    wait_for(lambda: set(names) <= {w["name"] for w in client.get("/workers").json()["workers"] if w["state"] != "down"},
             30, what="workers up")
    yield {"client": client, "base": base, "actors": actors, "names": names}
    client.close()
    serve.delete("faults")
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)


class Load:
    """Steady concurrent load: non-streaming chats plus streams; records every outcome."""

    def __init__(self, base: str, threads: int = 6, stream_every: int = 3, max_tokens: int = 8) -> None:
        self.base, self.threads, self.stream_every, self.max_tokens = base, threads, stream_every, max_tokens
        self.stop = threading.Event()
        self.results: list[tuple[str, int, str, str]] = []  # kind, status, worker, stream tail
        self._ts = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Load":
        for t in self._ts:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._ts:
            t.join(timeout=60)

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self.stop.is_set():
                n += 1
                body = {"model": "m", "max_tokens": self.max_tokens,
                        "messages": [{"role": "user", "content": f"load {i}-{n} " * 20}]}
                try:
                    if n % self.stream_every == 0:
                        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                            text = "".join(r.iter_text())
                        self.results.append(("stream", r.status_code, r.headers.get("x-kvroute-worker", ""), text[-200:]))
                    else:
                        r = c.post("/v1/chat/completions", json=body)
                        self.results.append(("plain", r.status_code, r.headers.get("x-kvroute-worker", ""), ""))
                except httpx.HTTPError as exc:
                    self.results.append(("plain" if n % self.stream_every else "stream", -1, "", type(exc).__name__))
                time.sleep(0.02)

    def plain(self) -> list[tuple[str, int, str, str]]:
        return [r for r in self.results if r[0] == "plain"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie that nobody reaped is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _workers(c) -> dict[str, dict]:
    return {w["name"]: w for w in c.get("/workers").json()["workers"]}


def test_kill_the_aggregator_under_load(env):
    import ray

    from actors.aggregator.actor import AGGREGATOR_NAME, NAMESPACE

    c = env["client"]
    agg = ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE)
    old = ray.get(agg.ping.remote())
    with Load(env["base"]) as load:
        time.sleep(1.0)
        ray.kill(agg, no_restart=False)
        new = wait_for(lambda: (e := ray.get(agg.ping.remote(), timeout=5)) != old and e, 20, what="restart")
        t_restart, restart_wall = time.monotonic(), time.time()
        wait_for(lambda: reregistered(c.get("/workers").json(), env["names"], new, restart_wall), 10, interval_s=0.01,
                 what="state whole again")
        whole_after = time.monotonic() - t_restart
        time.sleep(1.0)
    plain = load.plain()
    assert len(plain) > 20
    assert [r for r in plain if r[1] != 200] == []  # 0 failed non-streaming requests
    assert all(r[1] == 200 and r[3].rstrip().endswith("[DONE]") for r in load.results if r[0] == "stream")
    assert whole_after < 2 * 0.5 + 0.25, f"whole again {whole_after:.2f} s after the restart (2 heartbeats = 1 s)"


def test_kill_a_worker_actor_ray_restarts_it_and_the_worker_is_back(env):
    import ray

    c = env["client"]
    actor = env["actors"]["f0"]
    pid_before = _workers(c)["f0"]["managed"]["pid"]
    with Load(env["base"]) as load:
        time.sleep(0.5)
        ray.kill(actor, no_restart=False)
        back = wait_for(lambda: (s := ray.get(actor.stats.remote(), timeout=5)) and s, 60, what="actor restarted")
        w = wait_for(lambda: (x := _workers(c)["f0"])["state"] != "down" and x["managed"]["process"] == "running"
                     and x["managed"]["pid"] != pid_before and x, 60, what="worker f0 back with a fresh engine")
        time.sleep(0.5)
    assert back.name == "f0"
    assert w["managed"]["pid"] != pid_before  # a fresh engine under the restarted actor
    wait_for(lambda: not _alive(pid_before), 10, what="the dead actor's engine gone (no orphan)")
    plain = load.plain()
    assert plain and all(r[1] == 200 for r in plain), (Counter(r[1] for r in plain), [r for r in plain if r[1] != 200][:3])
    assert all(r[1] == 200 for r in load.results if r[0] == "stream")


def test_kill_a_worker_process_streams_end_cleanly_plain_requests_do_not_fail(env):
    c = env["client"]
    victim = "f1"
    pid = _workers(c)[victim]["managed"]["pid"]
    url = _workers(c)[victim]["url"]
    # long streams through the router (round_robin) until one runs on the victim
    tails: list[str] = []
    started: list[str] = []

    def long_stream():
        try:
            with httpx.Client(timeout=60) as hc:
                with hc.stream("POST", f"{env['base']}/v1/chat/completions",
                               headers={"x-kvroute-policy": "round_robin"},
                               json={"model": "m", "max_tokens": 4000, "stream": True,
                                     "messages": [{"role": "user", "content": "a very long answer please"}]}) as r:
                    worker = r.headers.get("x-kvroute-worker")
                    started.append(worker)
                    tails.append((worker, "".join(r.iter_text())[-400:]))
        except Exception as exc:  # a broken stream is a failure to report, not a silent thread death
            tails.append(("client error", repr(exc)))

    streams: list[threading.Thread] = []
    with Load(env["base"]) as load:
        for _ in range(8):  # round_robin puts one of every three on the victim unless one is excluded
            streams.append(threading.Thread(target=long_stream))
            streams[-1].start()
            wait_for(lambda: len(started) == len(streams), 10, what="stream headers")
            if victim in started:
                break
        assert victim in started, started
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: _workers(c)[victim]["state"] == "down", 5, interval_s=0.02, what="victim down")
        down_after = time.monotonic() - killed
        for t in streams:
            t.join(timeout=60)
        wait_for(lambda: _workers(c)[victim]["state"] != "down", 30, what="victim restarted by its actor")
    assert down_after < 1.0, f"down after {down_after:.2f} s"
    plain = load.plain()
    assert plain and all(r[1] == 200 for r in plain), Counter(r[1] for r in plain)
    assert len(tails) == len(streams) and not [t for w, t in tails if w == "client error"], tails
    on_victim = [tail for w, tail in tails if w == victim]
    assert on_victim, tails
    for tail in on_victim:
        assert '"error"' in tail and tail.rstrip().endswith("data: [DONE]")
    assert _workers(c)[victim]["url"] == url and _workers(c)[victim]["managed"]["restarts"] >= 1


def test_kill_a_router_replica_serve_replaces_it_and_the_other_keeps_serving(env):
    import ray

    def replicas() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::faults#KvRouter")]

    names = replicas()
    assert len(names) == 2
    victim = ray.get_actor(names[0], namespace="serve")
    with Load(env["base"], stream_every=1000) as load:
        time.sleep(0.5)
        ray.kill(victim, no_restart=True)
        t0 = time.monotonic()
        wait_for(lambda: len(r := replicas()) == 2 and names[0] not in r, 60, interval_s=0.5,
                 what="Serve replaced the replica")
        replaced_after = time.monotonic() - t0
        n_before = len(load.results)
        time.sleep(1.0)
    ok = sum(1 for r in load.results if r[1] == 200)
    assert ok >= 0.9 * len(load.results), Counter(r[1] for r in load.results)
    assert all(r[1] == 200 for r in load.results[n_before:])  # after replacement: nothing fails
    assert replaced_after < 60


def test_sigstop_a_worker_timeouts_and_health_move_traffic_away(env):
    c = env["client"]
    victim = "f2"
    pid = _workers(c)[victim]["managed"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: _workers(c)[victim]["state"] == "down", 10, interval_s=0.05, what="hung worker down")
        down_after = time.monotonic() - stopped
        with Load(env["base"], stream_every=1000) as load:
            time.sleep(2.0)
        served = Counter(r[2] for r in load.results if r[1] == 200)
        assert victim not in served and sum(served.values()) == len(load.results), served
        assert down_after < 5.0  # 2 probe timeouts of 1 s + a probe interval
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: _workers(c)[victim]["state"] != "down", 10, what="worker back after SIGCONT")
