"""The aggregator hosts the attach-mode workers of its own node (`actors.hosting.NodeHosting`, the
class a `MetricsHost` runs elsewhere): no host process on its node, its hosted workers re-bound when
Ray restarts it, and — passive liveness — a publishing worker probed rarely yet `down` ≤ 2 s after
it dies."""

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
def worker(agg, tmp_path):
    """One attach-mode worker (a /health server) started as `kvroute serve` starts it."""
    import ray

    from actors.fleet import WorkerSpec
    from actors.metrics_host import start_worker, stop_workers
    from actors.models import Settings

    server = HealthServer()
    spec = WorkerSpec(name=f"ah-{uuid.uuid4().hex[:6]}", url=server.url,
                      metrics_endpoint=f"ipc://{tmp_path}/ah.metrics", served_model_names=["m"])
    handle = start_worker(spec, Settings())
    ray.get(handle.ready.remote(), timeout=60)
    yield spec, handle, server
    stop_workers(names=[spec.name])
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


def test_a_worker_on_the_aggregators_node_is_hosted_by_the_aggregator_itself(agg, worker):
    import ray

    from actors.metrics_host import list_hosts

    spec, handle, _ = worker
    assert handle.host._actor_id == agg._actor_id  # no MetricsHost on the aggregator's node
    assert list_hosts() == []
    assert spec.name in ray.get(agg.hosted_workers.remote(), timeout=10)
    wait_for(lambda: (w := _worker(agg, spec.name)) is not None and w.state == "idle", 15, what="registered, idle")
    push = _push(spec.metrics_endpoint)
    try:
        push.send(encode_kv_metrics("0.5.23", **{**VALUES, "num_requests_waiting": 4}))
        wait_for(lambda: (w := _worker(agg, spec.name)).state == "live" and w.ranks[0].num_requests_waiting == 4, 10,
                 what="the SGLang frame in the registry")
    finally:
        push.close(linger=0)
    st = ray.get(handle.stats.remote(), timeout=10)
    assert st.name == spec.name and st.frames_accepted == 1 and st.healthy


def test_an_aggregator_restart_rebinds_its_hosted_workers_in_the_new_incarnation(agg, worker):
    import ray

    spec, _, _ = worker
    wait_for(lambda: (w := _worker(agg, spec.name)) is not None and w.state == "idle", 15, what="registered, idle")
    epoch = ray.get(agg.ping.remote(), timeout=10)
    ray.kill(agg, no_restart=False)  # Ray restarts it: soft state gone, hosted specs remembered
    wait_for(lambda: ray.get(agg.ping.remote(), timeout=5) != epoch, 60, interval_s=0.1, what="a new incarnation")
    assert spec.name in ray.get(agg.hosted_workers.remote(), timeout=10)
    wait_for(lambda: (w := _worker(agg, spec.name)) is not None and w.state == "idle", 5,
             what="the hosted worker back in the restarted aggregator's fleet")
    push = _push(spec.metrics_endpoint)  # the scheduler's PUSH reconnects to the re-bound PULL
    try:
        def live():
            push.send(encode_kv_metrics("0.5.23", **{**VALUES, "num_requests_waiting": 9}), zmq.NOBLOCK)
            w = _worker(agg, spec.name)
            return w.state == "live" and w.ranks[0].num_requests_waiting == 9

        wait_for(live, 10, interval_s=0.1, what="frames after the restart reach the new registry")
    finally:
        push.close(linger=0)


def test_a_publishing_worker_is_probed_rarely_and_is_down_within_2s_after_it_dies(agg, worker):
    import ray

    spec, _, server = worker
    wait_for(lambda: (w := _worker(agg, spec.name)) is not None and w.state == "idle", 15, what="registered, idle")
    stop = threading.Event()

    def scheduler() -> None:  # SGLang under load: tens of frames a second
        push = _push(spec.metrics_endpoint)
        i = 0
        while not stop.is_set():
            i += 1
            push.send(encode_kv_metrics("0.5.23", **{**VALUES, "request_active_slots": i % 64}))
            time.sleep(0.03)
        push.close(linger=0)

    t = threading.Thread(target=scheduler, daemon=True)
    t.start()
    try:
        wait_for(lambda: _worker(agg, spec.name).state == "live", 10, what="live")
        before = server.probes
        time.sleep(3.0)  # health_interval_s 1 s: an active prober would probe 3 times
        assert server.probes - before <= 1
    finally:
        stop.set()
        t.join()
    server.close()  # the worker is gone: no frames, no HTTP server
    died = time.monotonic()
    wait_for(lambda: _worker(agg, spec.name).state == "down", 10, interval_s=0.02, what="the dead worker down")
    down_after = time.monotonic() - died
    assert down_after <= 2.0, f"down {down_after:.2f} s after the worker died"
    stats = ray.get(agg.host_stats.remote(), timeout=10)
    assert stats.health_probes >= 1
