"""One Ray actor per SGLang worker, as `kvroute serve` starts them: a default fleet gets a live
`WorkerActor` for each of its workers and the aggregator hosts none; passive liveness (a publishing
worker is probed rarely, yet `down` ≤ 2 s after it dies); an aggregator restart leaves every
worker's actor (and its pid) untouched."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import zmq

from sim.sglang_shapes import encode_kv_metrics
from tests.integration.helpers import HealthServer, wait_for

pytestmark = pytest.mark.ray

VALUES = dict(request_active_slots=5, request_total_slots=64, kv_active_blocks=320, kv_total_blocks=6400,
              num_requests_waiting=0, gpu_cache_usage_perc=0.05, gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0)


@pytest.fixture
def fleet(agg, tmp_path):
    """Three attach-mode workers (one /health + /v1/models server) and a managed sim, with default
    settings, started as `kvroute serve` starts them (`start_worker` for every entry)."""
    import ray

    from actors.fleet import parse_fleet
    from actors.worker.actor import start_worker, stop_workers

    server = HealthServer()
    tag = uuid.uuid4().hex[:6]
    spec = parse_fleet({"workers": [
        *({"name": f"wa-{tag}-{i}", "url": server.url, "metrics_endpoint": f"ipc://{tmp_path}/wa{i}.metrics"}
          for i in range(3)),
        {"name": f"wa-{tag}-sim", "engine": "sim", "engine_args": {"time_scale": 0.2}},
    ]})
    handles = {w.name: start_worker(w, spec.settings) for w in spec.expanded()}
    ray.get([h.ready.remote() for h in handles.values()], timeout=120)
    yield spec, handles, server
    stop_workers(names=list(handles))
    server.close()


def _worker(agg, name):
    import ray

    from actors.protocol import decode_delta

    snap = decode_delta(ray.get(agg.snapshot.remote(), timeout=10))
    return next((w for w in snap.workers if w.name == name), None)


def _push(endpoint: str) -> zmq.Socket:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    return push


def test_a_default_fleet_has_one_live_actor_per_worker_and_the_aggregator_hosts_none(agg, fleet):
    import ray

    from actors.models import NAMESPACE

    spec, handles, _ = fleet
    names = [w.name for w in spec.expanded()]
    named = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE}
    assert {f"kvroute-worker-{n}" for n in names} <= named
    for n in names:  # each name is a live WorkerActor answering for its worker
        actor = ray.get_actor(f"kvroute-worker-{n}", namespace=NAMESPACE)
        assert actor._ray_actor_creation_function_descriptor.class_name == "WorkerActor"
        assert ray.get(actor.stats.remote(), timeout=10).name == n
    pids = {n: ray.get(h.__ray_call__.remote(lambda self: __import__("os").getpid()), timeout=10)
            for n, h in handles.items()}
    assert len(set(pids.values())) == len(names)  # a process each, none of them the aggregator's
    assert ray.get(agg.stats.remote(), timeout=10).pid not in pids.values()
    for n in names:  # every worker reached the aggregator through its own actor
        wait_for(lambda n=n: (w := _worker(agg, n)) is not None and w.state != "down", 20, what=f"{n} registered")


def test_a_publishing_worker_is_probed_rarely_and_is_down_within_2s_after_it_dies(agg, fleet):
    spec, _, server = fleet
    w0 = spec.workers[0]
    wait_for(lambda: (w := _worker(agg, w0.name)) is not None and w.state == "idle", 15, what="registered, idle")
    stop = threading.Event()

    def scheduler() -> None:  # SGLang under load: tens of frames a second
        push = _push(w0.metrics_endpoint)
        i = 0
        while not stop.is_set():
            i += 1
            push.send(encode_kv_metrics("0.5.23", **{**VALUES, "request_active_slots": i % 64}))
            time.sleep(0.03)
        push.close(linger=0)

    t = threading.Thread(target=scheduler, daemon=True)
    t.start()
    try:
        wait_for(lambda: _worker(agg, w0.name).state == "live", 10, what="live")
        before = server.probes
        time.sleep(3.0)  # health_interval_s 1 s: three silent workers share the server, this one is passive
        probes = server.probes - before
        assert probes <= 2 * 3 + 1 + 1, f"{probes} liveness probes in 3 s"  # the two silent ones, ~1/s each
    finally:
        stop.set()
        t.join()
    server.close()  # the worker is gone: no frames, no HTTP server
    died = time.monotonic()
    wait_for(lambda: _worker(agg, w0.name).state == "down", 10, interval_s=0.02, what="the dead worker down")
    down_after = time.monotonic() - died
    assert down_after <= 2.0, f"down {down_after:.2f} s after the worker died"


def test_an_aggregator_restart_leaves_every_worker_actor_running_and_they_report_again(agg, fleet):
    import ray

    from actors.aggregator.actor import AGGREGATOR_NAME
    from actors.models import NAMESPACE

    spec, handles, _ = fleet
    names = [w.name for w in spec.expanded()]
    pid_of = lambda h: ray.get(h.__ray_call__.remote(lambda self: __import__("os").getpid()), timeout=10)  # noqa: E731
    before = {n: pid_of(h) for n, h in handles.items()}
    engine_before = ray.get(handles[names[-1]].ready.remote(), timeout=10).managed.pid
    handle = ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE)
    old = ray.get(handle.ping.remote(), timeout=10)
    ray.kill(handle, no_restart=False)
    wait_for(lambda: ray.get(handle.ping.remote(), timeout=5) != old, 30, what="aggregator restarted by Ray")
    for n in names:
        wait_for(lambda n=n: (w := _worker(handle, n)) is not None and w.state != "down", 10,
                 what=f"{n} reported to the new aggregator")
    assert {n: pid_of(h) for n, h in handles.items()} == before
    assert ray.get(handles[names[-1]].ready.remote(), timeout=10).managed.pid == engine_before  # engine untouched
