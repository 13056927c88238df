"""serve_app.follower: applying deltas — only changed workers, names on membership change, epochs."""

from __future__ import annotations

from actors.models import Settings
from actors.protocol import RankMetrics, WorkerReport
from actors.aggregator.registry import FleetRegistry
from serve_app.follower import FleetFollower
from tests.ray_stub import Remote


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def report(name, seq=1, active=1, ranks=1):
    return WorkerReport(name=name, url=f"http://{name}", page_size=16, incarnation="i", healthy=True,
                        ranks=[RankMetrics(active, 8, 10, 100, 0, 0.1, 0.0, r, 0.0, seq) for r in range(ranks)])


async def _none():
    raise AssertionError("not connected in unit tests")


def test_a_follower_fed_deltas_holds_what_the_registry_holds():
    reg = FleetRegistry(Settings(), clock=Clock())
    f = FleetFollower(_none)
    reg.report(report("a"))
    reg.report(report("b", ranks=2))
    assert sorted(f.apply(reg.snapshot())) == ["a", "b"]
    reg.take_delta()
    reg.report(report("a", seq=2, active=5))
    d = reg.take_delta()
    assert d.prev_version <= f.version < d.version
    assert f.apply(d) == ["a"]
    assert f.workers["a"].metrics["request_active_slots"] == 5
    assert f.workers["b"].metrics["request_active_slots"] == 2  # two ranks summed
    assert [r["data_parallel_rank"] for r in f.workers["b"].ranks] == [0, 1]
    assert f.version == reg.version


def test_a_removal_reaches_the_follower_through_the_name_list():
    reg = FleetRegistry(Settings(), clock=Clock())
    f = FleetFollower(_none)
    reg.report(report("a"))
    reg.report(report("b"))
    f.apply(reg.take_delta())
    reg.remove("a")
    assert f.apply(reg.take_delta()) == ["a"]
    assert list(f.workers) == ["b"]


def test_a_full_snapshot_of_a_new_epoch_replaces_everything_once_the_grace_ends():
    old, new = FleetRegistry(Settings(), clock=Clock()), FleetRegistry(Settings(), clock=Clock())
    f = FleetFollower(_none, resync_grace_s=3.0)
    old.report(report("a"))
    f.apply(old.snapshot(), received_at=10.0)
    new.report(report("b"))
    f.apply(new.snapshot(), received_at=10.0)
    assert f.epoch == new.epoch
    assert sorted(f.workers) == ["a", "b"]  # a restarted aggregator's first snapshot may be partial
    assert f.expire_carried(12.9) == [] and f.expire_carried(13.0) == ["a"]
    assert list(f.workers) == ["b"]


def test_a_snapshot_names_the_workers_it_no_longer_holds_as_changed():
    """A worker removed while the follower was cut off (missed delta, aggregator restart) is absent
    from the snapshot that resyncs it: the router must hear of it, or it keeps routing there. After
    a restart only once the grace for re-registering has passed; a worker that comes back in it stays."""
    old, new = FleetRegistry(Settings(), clock=Clock()), FleetRegistry(Settings(), clock=Clock())
    f = FleetFollower(_none, resync_grace_s=3.0)
    old.report(report("a"))
    old.report(report("gone"))
    old.report(report("late"))
    f.apply(old.snapshot(), received_at=10.0)
    new.report(report("a"))
    assert f.apply(new.snapshot(), received_at=10.0) == ["a"]
    assert sorted(f.workers) == ["a", "gone", "late"]
    new.take_delta()
    new.report(report("late"))  # re-registers with the new aggregator within the grace
    assert f.apply(new.take_delta(), received_at=11.0) == ["late"]
    assert f.expire_carried(12.9) == [] and f.expire_carried(13.5) == ["gone"]  # (checked per frame/keep-alive)
    assert sorted(f.workers) == ["a", "late"]
    same = FleetRegistry(Settings(), clock=Clock())  # same epoch, full snapshot after a missed delta
    same.report(report("a"))
    same.report(report("b"))
    f2 = FleetFollower(_none)
    f2.apply(same.snapshot())
    same.remove("b")
    assert sorted(f2.apply(same.snapshot())) == ["a", "b"]
    assert list(f2.workers) == ["a"]


def test_the_managed_process_and_kv_event_subscription_reach_the_record_by_name():
    from actors.protocol import KvEventsStatus, KvHandshakeSide, ManagedEngine

    reg = FleetRegistry(Settings(), clock=Clock())
    f = FleetFollower(_none)
    kv = KvEventsStatus(status="ok", handshake=[KvHandshakeSide(0, "bind", "tcp://127.0.0.1:5")], batches=3)
    base = report("a")
    reg.report(base)
    f.apply(reg.take_delta())
    assert f.workers["a"].kv_events_actor is None and f.workers["a"].managed_view() is None
    import msgspec

    reg.report(msgspec.structs.replace(base, managed=ManagedEngine(process="running", pid=7),
                                       kv_events_actor="kvroute-worker-a", kv_events=kv))
    assert f.apply(reg.take_delta()) == ["a"]  # a slow field changed: the whole record travels
    rec = f.workers["a"]
    assert rec.kv_events_actor == "kvroute-worker-a" and rec.kv_events == kv and rec.managed.pid == 7
    assert rec.managed_view() == {  # what /workers shows, as before the fields were named
        "process": "running", "pid": 7, "restarts": 0, "last_exit": None, "detail": "",
        "kv_events_actor": "kvroute-worker-a",
        "kv_events": {"status": "ok", "batches": 3,
                      "handshake": [{"rank": 0, "kvroute": "bind", "address": "tcp://127.0.0.1:5"}]},
    }


def test_a_worker_record_is_built_with_keywords_only():
    import pytest

    from serve_app.follower import WorkerRecord

    with pytest.raises(TypeError):
        WorkerRecord("w", "u", 16, "live", True)  # noqa: the 11-positional form is gone
    rec = WorkerRecord(name="w", url="u", page_size=16, state="live", healthy=True, heartbeat_at=1.0)
    assert rec.metrics is None and rec.ranks == [] and rec.in_flight_by_replica == {}


def test_the_follower_learns_which_router_replicas_share_counts_as_they_come_and_expire():
    """The sharing replicas travel in the deltas (`FleetDelta.replicas`): an arrival is a delta even
    when its counts are empty and no worker changed; an expiry too; a snapshot always carries them."""
    clock = Clock()
    s = Settings()
    reg = FleetRegistry(s, clock=clock)
    f = FleetFollower(_none)
    reg.report(report("a"))
    f.apply(reg.snapshot())
    reg.take_delta()
    assert f.replicas == frozenset()
    assert reg.report_in_flight("r1", {})  # an announcement: no counts, still news
    d = reg.take_delta()
    assert d is not None and d.workers == [] and d.replicas == ["r1"]
    f.apply(d)
    assert f.replicas == {"r1"}
    assert not reg.report_in_flight("r1", {})  # the same again: nothing to publish
    reg.report_in_flight("r1", {"a": 2})
    d = reg.take_delta()
    assert d.replicas is None and [w.name for w in d.workers] == ["a"]  # unchanged membership is not resent
    f.apply(d)
    assert f.replicas == {"r1"}
    reg.report_in_flight("r2", {"a": 1})
    f.apply(reg.take_delta())
    assert f.replicas == {"r1", "r2"}
    fresh = FleetFollower(_none)
    fresh.apply(reg.snapshot())
    assert fresh.replicas == {"r1", "r2"}
    clock.t += s.down_after_s * 2 + 0.1  # both stopped sharing: expired
    reg.report(report("a", seq=2))
    assert reg.tick()
    f.apply(reg.take_delta())
    assert f.replicas == frozenset()


def test_a_worker_missing_from_a_resync_snapshot_is_no_longer_routed_to():
    from serve_app.config import RouterConfig
    from serve_app.router import RouterCore

    reg = FleetRegistry(Settings(), clock=Clock())
    core = RouterCore(RouterConfig(), FleetFollower(_none), "r0")
    for n in ("a", "b"):
        reg.report(report(n))
    core.on_fleet_update(core.follower.apply(reg.snapshot()))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert {core.decide(core.facts(body), "round_robin")[0].worker for _ in range(4)} == {"a", "b"}
    reg.remove("b")
    core.on_fleet_update(core.follower.apply(reg.snapshot()))  # the delta naming it was missed (same epoch)
    assert {core.decide(core.facts(body), "round_robin")[0].worker for _ in range(4)} == {"a"}



async def test_a_restarted_aggregators_stream_is_followed_from_its_start_without_a_snapshot():
    """A restarted aggregator publishes from version 0 on the same address: a follower that hears its
    first delta needs no snapshot through Ray (whose news of the restart reaches the process late
    under load); one that missed that delta resyncs through a snapshot as before. Real PUB/SUB."""
    import asyncio

    import zmq
    import zmq.asyncio

    from actors.protocol import Endpoints, encode_delta

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    reg = {"now": FleetRegistry(Settings(), clock=Clock())}
    snapshots = []

    async def endpoints(ip):
        return Endpoints(epoch=reg["now"].epoch, ingest="tcp://127.0.0.1:1", publish=f"tcp://127.0.0.1:{port}",
                         token="t")

    async def snapshot():
        snapshots.append(reg["now"].epoch)
        return encode_delta(reg["now"].snapshot())

    class Agg:
        pass

    agg = Agg()
    agg.endpoints, agg.snapshot = Remote(endpoints), Remote(snapshot)

    async def resolve():
        return agg

    async def until(pred, what):
        for _ in range(500):
            if pred():
                return
            pub.send(encode_delta(reg["now"].keepalive()))  # (keeps the stream alive, as the aggregator does)
            await asyncio.sleep(0.01)
        raise AssertionError(what)

    f = FleetFollower(resolve, silence_s=5.0)
    f.start()
    try:
        reg["now"].report(report("a"))
        reg["now"].take_delta()
        await until(lambda: "a" in f.workers, "first snapshot")
        assert len(snapshots) == 1
        # restarted: a new registry, its stream heard from its first delta
        reg["now"] = FleetRegistry(Settings(), clock=Clock())
        reg["now"].report(report("b"))
        pub.send(encode_delta(reg["now"].take_delta()))
        await until(lambda: f.epoch == reg["now"].epoch and "b" in f.workers, "the new epoch's first delta")
        assert len(snapshots) == 1 and f.restarts_followed == 1
        assert sorted(f.workers) == ["a", "b"]  # a carried for its grace, as after a snapshot
        reg["now"].report(report("a", seq=2, active=7))
        pub.send(encode_delta(reg["now"].take_delta()))
        await until(lambda: f.workers["a"].metrics["request_active_slots"] == 7, "the next delta")
        assert f.expire_carried() == []  # a re-registered: no longer carried
        # restarted again, and this time its first delta is missed: a snapshot
        reg["now"] = FleetRegistry(Settings(), clock=Clock())
        reg["now"].report(report("c"))
        reg["now"].take_delta()  # published while nobody listened
        reg["now"].report(report("c", seq=2))
        pub.send(encode_delta(reg["now"].take_delta()))
        await until(lambda: f.epoch == reg["now"].epoch and "c" in f.workers, "resync after a missed first delta")
        assert len(snapshots) == 2 and f.restarts_followed == 1
    finally:
        await f.stop()
        pub.close(linger=0)
        ctx.term()


def test_heartbeats_that_change_nothing_keep_the_routers_heartbeat_age_fresh():
    """A live worker's `heartbeat_age_s` in /workers stays below a couple of heartbeats while it serves
    (its rank updates carry it) and while it idles (the keep-alive names the workers heard), though
    neither a heartbeat nor a rank update publishes a new whole record."""
    clock = Clock()
    reg = FleetRegistry(Settings(), clock=clock)
    f = FleetFollower(_none)
    reg.report(report("a"))
    reg.report(report("b", ranks=0))
    f.apply(reg.snapshot())
    reg.take_delta()
    for _ in range(6):  # 9 s: "a" serves (new ranks), "b" idles (heartbeats, no metrics: SGLang is silent)
        clock.t += 1.0
        reg.report(report("a", seq=int(clock.t)))
        reg.report(report("b", ranks=0))
        d = reg.take_delta()
        assert [m.name for m in d.metrics] == ["a"] and d.heard == ["b"] and not d.workers
        f.apply(d, received_at=clock.t)
        clock.t += 0.5
        reg.report(report("b", ranks=0))
        k = reg.keepalive()
        assert k.heard == ["b"] and k.version == f.version
        f.heard(k.heard, now=clock.t)
    for name in ("a", "b"):
        assert clock.t - f.workers[name].heartbeat_at <= 0.5, name
    assert reg.keepalive().heard == []  # each heartbeat is named once
