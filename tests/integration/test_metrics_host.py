"""Node hosting on one local Ray: a real `MetricsHost` hosting attach-mode workers — their metrics
and liveness in one batched frame per window, all of them `down` ≤ 2 s after the host dies, back
after Ray restarts it, and the handle callers use (`ready`/`stats`/`stop`) addressed by worker —
and owning managed engines (real simulated SGLang processes): launched, restarted, stopped with
their worker, launched again when Ray restarts the host."""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from tests.integration.helpers import HealthServer, wait_for

pytestmark = pytest.mark.ray

PREFIX = "test-metrics-host-"


@pytest.fixture
def hosted(agg, tmp_path):
    """Two attach-mode workers (a /health server each) hosted by this node's metrics host."""
    import ray

    from actors.fleet import WorkerSpec
    from actors.metrics_host import remove_hosted, start_hosted_worker
    from actors.models import Settings

    servers = [HealthServer(), HealthServer()]
    tag = uuid.uuid4().hex[:6]
    specs = [WorkerSpec(name=f"mh-{tag}-{i}", url=s.url, metrics_endpoint=f"ipc://{tmp_path}/mh{i}.metrics")
             for i, s in enumerate(servers)]
    handles = [start_hosted_worker(s, Settings(), prefix=PREFIX) for s in specs]
    ray.get([h.ready.remote() for h in handles], timeout=60)
    yield specs, handles, servers
    remove_hosted(prefix=PREFIX)
    for s in servers:
        s.close()
    for s in specs:
        ray.get(agg.remove.remote(s.name), timeout=10)


def _states(agg, names) -> dict[str, str]:
    import ray

    from actors.protocol import decode_delta

    snap = decode_delta(ray.get(agg.snapshot.remote(), timeout=10))
    return {w.name: w.state for w in snap.workers if w.name in names}


def _snapshot_worker(agg, name):
    import ray

    from actors.protocol import decode_delta

    snap = decode_delta(ray.get(agg.snapshot.remote(), timeout=10))
    return next((w for w in snap.workers if w.name == name), None)


def test_hosted_workers_register_through_one_host_and_their_metrics_reach_the_aggregator(agg, hosted):
    import ray

    from sim.sglang_shapes import encode_kv_metrics

    specs, handles, _ = hosted
    names = [s.name for s in specs]
    wait_for(lambda: _states(agg, names) == {n: "idle" for n in names}, 15, what="both hosted workers idle")
    host = handles[0].host
    stats = ray.get(host.host_stats.remote(), timeout=10)
    assert set(names) <= set(stats.workers) and stats.frames >= 1
    assert ray.get(agg.stats.remote(), timeout=10).host_frames >= 1
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(specs[1].metrics_endpoint)
    try:
        push.send(encode_kv_metrics("0.5.23", request_active_slots=5, request_total_slots=64, kv_active_blocks=320,
                                    kv_total_blocks=6400, num_requests_waiting=2, gpu_cache_usage_perc=0.05,
                                    gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0))

        def live():
            w = _snapshot_worker(agg, names[1])
            return w is not None and w.state == "live" and w.ranks and w.ranks[0].num_requests_waiting == 2

        wait_for(live, 10, what="the hosted worker's SGLang frame in the aggregator")
    finally:
        push.close(linger=0)
    assert _states(agg, names)[names[0]] == "idle"  # only the worker that sent a frame is live
    st = ray.get(handles[1].stats.remote(), timeout=10)
    assert st.name == names[1] and st.frames_accepted == 1 and st.healthy


def test_a_hosted_workers_own_health_failure_takes_only_it_down(agg, hosted):
    specs, _, servers = hosted
    names = [s.name for s in specs]
    wait_for(lambda: _states(agg, names) == {n: "idle" for n in names}, 15, what="both hosted workers idle")
    servers[0].healthy = False
    wait_for(lambda: _states(agg, names) == {names[0]: "down", names[1]: "idle"}, 10,
             what="the unhealthy worker down, its host-mate not")
    servers[0].healthy = True
    wait_for(lambda: _states(agg, names)[names[0]] == "idle", 10, what="the worker healthy again")


def test_when_the_host_dies_all_its_workers_are_down_within_2s(agg, hosted):
    import ray

    from actors.models import Settings

    specs, handles, _ = hosted
    names = [s.name for s in specs]
    wait_for(lambda: _states(agg, names) == {n: "idle" for n in names}, 15, what="both hosted workers idle")
    ray.kill(handles[0].host, no_restart=True)  # the process dies for good (a restart could beat the 2 s)
    killed = time.monotonic()
    wait_for(lambda: set(_states(agg, names).values()) == {"down"}, 10, interval_s=0.02,
             what="the dead host's workers down")
    down_after = time.monotonic() - killed
    # its last frame (every heartbeat_s, 0.5 s) came before the kill: down_after_s (2 s) + one state tick
    assert down_after <= 2.0 + Settings().state_tick_s + 0.05, f"down {down_after:.2f} s after the host died"


def test_a_host_restarted_by_ray_hosts_the_same_workers_again(agg, hosted):
    import ray

    specs, handles, _ = hosted
    names = [s.name for s in specs]
    host = handles[0].host
    wait_for(lambda: _states(agg, names) == {n: "idle" for n in names}, 15, what="both hosted workers idle")
    before = ray.get(host.host_stats.remote(), timeout=10).incarnation
    ray.kill(host, no_restart=False)  # Ray restarts it: it remembers its workers (Ray's internal KV)
    restarted = wait_for(lambda: (st := ray.get(host.host_stats.remote(), timeout=5)).incarnation != before and st,
                         60, interval_s=0.1, what="the host restarted by Ray")
    assert set(names) <= set(restarted.workers)
    wait_for(lambda: _states(agg, names) == {n: "idle" for n in names}, 15, what="the workers served again")


def test_stopping_a_hosted_worker_removes_it_from_the_host_and_the_fleet(agg, hosted):
    import ray

    specs, handles, _ = hosted
    names = [s.name for s in specs]
    wait_for(lambda: len(_states(agg, names)) == 2, 15, what="both registered")
    assert ray.get(handles[0].stop.remote(), timeout=10)  # deregister=True, as WorkerActor.stop
    wait_for(lambda: names[0] not in _states(agg, names), 10, what="the stopped worker gone from the fleet")
    assert names[0] not in ray.get(handles[0].host.hosted_workers.remote(), timeout=10)
    time.sleep(2.5)  # the host's later frames no longer name it: it does not come back
    assert _states(agg, names) == {names[1]: "idle"}


def test_a_worker_that_needs_its_own_actor_is_refused_by_the_host(agg, tmp_path):
    import ray

    from actors.fleet import WorkerSpec
    from actors.metrics_host import hostable, start_hosted_worker, start_worker
    from actors.models import Settings
    from actors.worker_actor import kill_worker_actors

    kv = WorkerSpec(name="mh-kv", url="http://127.0.0.1:9", metrics_endpoint=f"ipc://{tmp_path}/k.metrics",
                    kv_events_endpoint="tcp://127.0.0.1:5999")
    # attach mode asking Ray for resources: its own actor holds them
    held = WorkerSpec(name="mh-held", url="http://127.0.0.1:9", metrics_endpoint=f"ipc://{tmp_path}/a.metrics",
                      num_cpus=0.1)
    assert not hostable(held)
    # hostable: KV events (the host serves the KV log), managed engines, with Ray resources too (a placement group)
    assert hostable(kv) and hostable(WorkerSpec(name="mh-sim", engine="sim"))
    assert hostable(WorkerSpec(name="g", engine="sim", num_gpus=1))
    with pytest.raises(Exception, match="not hostable"):
        ray.get(start_hosted_worker(held, Settings(), prefix=PREFIX).ready.remote(), timeout=30)
    # the dispatcher gives it its own WorkerActor instead
    handle = start_worker(held, Settings(metrics_hosting="node"))
    try:
        assert not hasattr(handle, "host")
        assert ray.get(handle.ready.remote(), timeout=30).name == "mh-held"
    finally:
        kill_worker_actors(names=["mh-held"])
        ray.get(agg.remove.remote("mh-held"), timeout=10)


def test_a_hosted_engines_ray_resources_are_held_by_a_placement_group_until_it_is_removed(agg):
    import ray

    from actors.fleet import WorkerSpec
    from actors.metrics_host import start_worker, stop_workers
    from actors.models import Settings
    from actors.reservation import ReservationError, group_name

    def groups() -> dict[str, dict]:
        return {g["name"]: g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"}

    spec = WorkerSpec(name=f"mh-res-{uuid.uuid4().hex[:6]}", engine="sim", num_cpus=0.5,
                      engine_args={"time_scale": 0.25})
    handle = start_worker(spec, Settings())
    try:
        info = ray.get(handle.ready.remote(), timeout=120)
        held = groups()[group_name(spec.name)]
        assert held["bundles"] == {0: {"CPU": 0.5}} and info.node_id == ray.get(agg.node_id.remote(), timeout=10)
        assert handle.host._actor_id == agg._actor_id  # placed on the aggregator's node: the aggregator hosts it
        # what cannot be held anywhere is a clear error, not a worker that waits for ever
        with pytest.raises(ReservationError, match="cannot reserve"):
            start_worker(WorkerSpec(name="mh-res-huge", engine="sim", num_gpus=64), Settings(reserve_timeout_s=2))
        assert group_name("mh-res-huge") not in groups()
        assert ray.get(handle.stop.remote(), timeout=20)  # removing the worker frees its resources
        wait_for(lambda: group_name(spec.name) not in groups(), 10, what="its placement group removed")
    finally:
        stop_workers(names=[spec.name])
    wait_for(lambda: not _alive(info.managed.pid), 10, what="its engine stopped")


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (reaped later by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _keeper_of(pid: int) -> bool:
    """True if `pid`'s parent is a kvroute engine keeper."""
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        return b"actors.keeper" in f.read()


@pytest.fixture
def engine(agg):
    """One managed simulated SGLang worker whose engine process this node's metrics host owns."""
    import ray

    from actors.fleet import WorkerSpec
    from actors.metrics_host import remove_hosted, start_hosted_worker
    from actors.models import Settings

    spec = WorkerSpec(name=f"mh-eng-{uuid.uuid4().hex[:6]}", engine="sim", page_size=16,
                      engine_args={"time_scale": 0.25})
    handle = start_hosted_worker(spec, Settings(), prefix=PREFIX)
    info = ray.get(handle.ready.remote(), timeout=120)
    yield spec, handle, info
    remove_hosted(prefix=PREFIX)
    ray.get(agg.remove.remote(spec.name), timeout=10)


def test_a_hosted_managed_engine_is_launched_reported_and_restarted_by_its_host(agg, engine):
    import os
    import signal

    import httpx
    import ray

    spec, handle, info = engine
    assert info.managed is not None and info.managed.process == "running" and _alive(info.managed.pid)
    assert httpx.get(f"{info.url}/health", timeout=5).status_code == 200
    # the host owns the engine (through its keeper): no WorkerActor exists for it
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if spec.name in str(a)]
    assert _keeper_of(info.managed.pid)
    w = wait_for(lambda: (x := _snapshot_worker(agg, spec.name)) is not None and x.state == "idle" and x, 15,
                 what="the managed worker idle in the aggregator's fleet")
    assert w.managed.pid == info.managed.pid and w.url == info.url
    # its KvMetrics reach the aggregator through the host's frame (the engine sends them per batch)
    httpx.post(f"{info.url}/generate", json={"text": "hello " * 200, "sampling_params": {"max_new_tokens": 64}},
               timeout=30)
    wait_for(lambda: _snapshot_worker(agg, spec.name).ranks, 10, what="its KvMetrics reported")
    # the engine dies: down at once (not at the next probe), then launched again with a new pid
    os.kill(info.managed.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: _snapshot_worker(agg, spec.name).state == "down", 5, interval_s=0.02, what="down")
    assert time.monotonic() - killed <= 2.0
    back = wait_for(lambda: (x := _snapshot_worker(agg, spec.name)).state == "idle" and x.managed.pid != info.managed.pid
                    and x, 60, what="the engine launched again")
    assert back.managed.restarts >= 1 and _alive(back.managed.pid)


def test_stopping_a_hosted_managed_worker_stops_its_engine(agg, engine):
    import ray

    spec, handle, info = engine
    pid = info.managed.pid
    assert ray.get(handle.stop.remote(), timeout=20)
    wait_for(lambda: not _alive(pid), 10, what="the engine process gone")
    wait_for(lambda: _snapshot_worker(agg, spec.name) is None, 10, what="the worker gone from the fleet")


def test_a_host_restarted_by_ray_adopts_its_running_engines(agg, engine):
    import ray

    spec, handle, info = engine
    before = ray.get(handle.host.host_stats.remote(), timeout=10).incarnation
    ray.kill(handle.host, no_restart=False)  # the host dies; its engine's keeper waits engine_adopt_grace_s
    wait_for(lambda: ray.get(handle.host.host_stats.remote(), timeout=5).incarnation != before, 60, interval_s=0.1,
             what="the host restarted by Ray")
    back = wait_for(lambda: (x := _snapshot_worker(agg, spec.name)) is not None and x.state == "idle"
                    and x.managed is not None and x.managed.pid == info.managed.pid and x, 30,
                    what="the restarted host serving the same engine")
    assert back.managed.restarts == 0 and back.url == info.url and _alive(info.managed.pid)
    # and it still owns it: stopping the worker stops the adopted engine
    assert ray.get(handle.stop.remote(), timeout=20)
    wait_for(lambda: not _alive(info.managed.pid), 10, what="the adopted engine stopped with its worker")


def test_the_aggregator_owns_its_nodes_engines_and_adopts_them_after_its_restart(agg):
    import httpx
    import ray

    from actors.fleet import WorkerSpec
    from actors.metrics_host import start_worker
    from actors.models import Settings

    spec = WorkerSpec(name=f"mh-agg-{uuid.uuid4().hex[:6]}", engine="sim", page_size=16,
                      engine_args={"time_scale": 0.25})
    handle = start_worker(spec, Settings())  # managed, on the aggregator's node: the aggregator hosts it
    assert handle.host._actor_id == agg._actor_id
    info = ray.get(handle.ready.remote(), timeout=120)
    try:
        assert _keeper_of(info.managed.pid)
        wait_for(lambda: (x := _snapshot_worker(agg, spec.name)) is not None and x.state == "idle", 15,
                 what="the engine idle in the fleet")
        epoch = ray.get(agg.endpoints.remote(), timeout=10).epoch
        ray.kill(agg, no_restart=False)
        wait_for(lambda: ray.get(agg.endpoints.remote(), timeout=5).epoch != epoch, 60, interval_s=0.1,
                 what="the aggregator restarted by Ray")
        back = wait_for(lambda: (x := _snapshot_worker(agg, spec.name)) is not None and x.state == "idle" and x, 30,
                        what="the engine back in the restarted aggregator's fleet")
        assert back.managed.pid == info.managed.pid and back.managed.restarts == 0
        assert httpx.get(f"{info.url}/health", timeout=5).status_code == 200
    finally:
        ray.get(handle.stop.remote(), timeout=20)
    wait_for(lambda: not _alive(info.managed.pid), 10, what="the engine stopped with its worker")


def test_a_large_fleet_shortens_every_hosts_window_through_the_aggregator_and_a_quiet_one_restores_it(agg, hosted):
    """The fleet-wide window (`actors.fleet_window`): while the aggregator takes ≥ 800 changed reports/s
    it hands `fleet_window_s` to every metrics host (the host's link long-polls it), and `coalesce_s`
    again once the fleet is quiet."""
    import ray

    from actors.models import Settings
    from actors.protocol import RankMetrics, ReportBatch, WorkerReport, encode

    s = Settings()
    specs, handles, _ = hosted
    host = handles[0].host
    wait_for(lambda: ray.get(host.host_stats.remote(), timeout=10).window_s == s.coalesce_s, 15,
             what="the host to learn the small fleet's window")
    ep = ray.get(agg.endpoints.remote("127.0.0.1"), timeout=10)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(ep.ingest)
    tag = uuid.uuid4().hex[:6]
    names = [f"big-{tag}-{i}" for i in range(40)]
    seq = 0

    def burst(seconds: float) -> None:  # 40 emulated workers' changed reports, ~1,600/s
        nonlocal seq
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seq += 1
            reports = [WorkerReport(name=n, url=f"http://{n}", page_size=1, incarnation=tag, healthy=True,
                                    ranks=[RankMetrics(1, 8, 1, 10, 0, 0.1, 0.0, 0, 0.0, seq)]) for n in names]
            push.send(encode(ReportBatch(token=ep.token, reports=reports)))
            time.sleep(0.025)

    try:
        deadline = time.monotonic() + 15
        while ray.get(host.host_stats.remote(), timeout=10).window_s != s.fleet_window_s:
            assert time.monotonic() < deadline, "the host never heard the large fleet's window"
            burst(0.5)
        assert ray.get(agg.stats.remote(), timeout=10).host_window_s == s.fleet_window_s
        wait_for(lambda: ray.get(host.host_stats.remote(), timeout=10).window_s == s.coalesce_s, 10,
                 what="the host to hear the window of a fleet gone quiet")
        assert ray.get(agg.stats.remote(), timeout=10).host_window_s == s.coalesce_s
    finally:
        push.close(linger=0)
        for n in names:
            ray.get(agg.remove.remote(n), timeout=10)
