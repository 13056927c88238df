"""Routing through the real router and simulated workers: ledger, retries, breaker, /metrics."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections import Counter

import httpx
import pytest

from actors.fleet import parse_fleet
from tests.integration.helpers import BrokenWorker, wait_for

pytestmark = pytest.mark.ray
PREFIX = "/live"
N = 3


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("live")
    broken = BrokenWorker(500)
    fleet = parse_fleet({"workers": [
        *[{"name": f"s{i}", "engine": "sim", "page_size": 16, "metrics_endpoint": f"ipc://{tmp}/s{i}.metrics",
           "engine_args": {"time_scale": 0.2, "max_running_requests": 64}} for i in range(N)],
        {"name": "broken", "url": broken.url, "metrics_endpoint": f"ipc://{tmp}/broken.metrics"},
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="live-") for w in fleet.workers}
    ray.get([a.ready.remote() for a in actors.values()], timeout=120)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"),
                         "router": {"policy": "kv_aware", "seed": 3, "breaker": {"failures_to_open": 2, "open_s": 30}}}),
              name="live", route_prefix=PREFIX)
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}", timeout=60)
    wait_for(lambda: sum(w["state"] != "down" for w in client.get("/workers").json()["workers"]) == N + 1, 30,
             what="all workers up")
    yield {"client": client, "broken": broken, "actors": actors}
    client.close()
    serve.delete("live")
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)
    broken.close()


def chat(i: int, content: str | None = None, max_tokens: int = 4) -> dict:
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content or f"distinct prompt number {i} " * 30}]}


def test_broken_worker_is_retried_elsewhere_then_its_breaker_opens(env):
    c, broken = env["client"], env["broken"]
    codes = []
    for i in range(12):
        r = c.post("/v1/chat/completions", json=chat(i), headers={"x-kvroute-policy": "round_robin"})
        codes.append(r.status_code)
        assert r.headers.get("x-kvroute-worker") != "broken"
    assert codes == [200] * 12  # every attempt that hit the broken worker was retried on another one
    assert broken.posts == 2  # two failures opened its breaker; round_robin never reached it again
    metrics = c.get("/metrics").text
    assert 'kvroute_breaker_state{worker="broken"} 2.0' in metrics
    assert 'kvroute_retries_total{worker="broken"} 2.0' in metrics


def test_a_burst_between_reports_does_not_herd(env):
    c = env["client"]
    with cf.ThreadPoolExecutor(12) as pool:
        futs = [pool.submit(c.post, "/v1/chat/completions", json=chat(100 + i, max_tokens=64)) for i in range(12)]
        workers = Counter(f.result().headers["x-kvroute-worker"] for f in futs)
    assert all(f.result().status_code == 200 for f in futs)
    assert max(workers.values()) <= 6, workers  # no worker more than half
    assert set(workers) <= {"s0", "s1", "s2"}


def test_a_conversation_stays_on_its_worker(env):
    c = env["client"]
    system = "You are a meticulous assistant. " * 60
    history = [{"role": "system", "content": system}]
    seen = []
    for turn in range(4):
        history.append({"role": "user", "content": f"question {turn}: tell me about item {turn}"})
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": history, "max_tokens": 8})
        assert r.status_code == 200
        seen.append(r.headers["x-kvroute-worker"])
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert len(set(seen)) == 1, seen
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.5 * usage["prompt_tokens"]


def test_killed_worker_process_loses_no_non_streaming_request_and_comes_back(env):
    c = env["client"]
    workers = {w["name"]: w for w in c.get("/workers").json()["workers"]}
    victim = "s1"
    pid = workers[victim]["managed"]["pid"]
    results: list[int] = []

    def send(i):
        return c.post("/v1/chat/completions", json=chat(1000 + i, max_tokens=8),
                      headers={"x-kvroute-policy": "round_robin"}).status_code

    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(send, i) for i in range(40)]
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = [f.result() for f in futs]
    assert results.count(200) == len(results), Counter(results)
    w = wait_for(lambda: (x := {w["name"]: w for w in c.get("/workers").json()["workers"]}[victim])["state"] == "down" and x,
                 5, what="victim down")
    assert time.monotonic() - killed < 5
    # managed mode restarts the engine; the worker returns
    back = wait_for(lambda: (x := {w["name"]: w for w in c.get("/workers").json()["workers"]}[victim])["state"] != "down" and x,
                    30, what="victim restarted")
    assert back["managed"]["restarts"] >= 1 and back["managed"]["pid"] != pid
    del w


def test_streams_pass_through_and_metrics_count_them(env):
    c = env["client"]
    with c.stream("POST", "/v1/chat/completions", json={**chat(7), "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    text = c.get("/metrics").text
    for name in ("kvroute_requests_total", "kvroute_decision_seconds_bucket", "kvroute_upstream_ttft_seconds_bucket",
                 "kvroute_upstream_duration_seconds_bucket", "kvroute_worker_state", "kvroute_worker_in_flight_requests",
                 "kvroute_snapshot_age_seconds", "kvroute_worker_kv_usage_ratio"):
        assert name in text, name
    assert 'outcome="ok"' in text


def _held_count(c) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("kvroute_admission_held_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def test_a_burst_of_big_streamed_prompts_waits_in_the_router_for_workers_to_free_up(env):
    """router.admission: once every routable worker prefills one of this replica's streams, big cold
    prompts wait in the router and go out as first tokens arrive — every one answered in full."""
    c = env["client"]
    # the broken worker must be out of the way (breaker open for 30 s), or it would look free
    for i in range(12):
        if 'kvroute_breaker_state{worker="broken"} 2.0' in c.get("/metrics").text:
            break
        c.post("/v1/chat/completions", json=chat(300 + i), headers={"x-kvroute-policy": "round_robin"})
    assert 'kvroute_breaker_state{worker="broken"} 2.0' in c.get("/metrics").text
    before = _held_count(c)

    def stream(i: int) -> tuple[int, str, str]:
        body = {**chat(i, f"a long document number {i}, to be summarised carefully. " * 120, max_tokens=8),
                "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            return r.status_code, "".join(r.iter_text()), r.headers.get("x-kvroute-worker", "")

    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(stream, range(200, 212)))
    assert [code for code, _, _ in results] == [200] * 12
    assert all(text.rstrip().endswith("data: [DONE]") for _, text, _ in results)
    assert {w for _, _, w in results} <= {"s0", "s1", "s2"}
    assert _held_count(c) > before  # some of the burst waited for a first token
