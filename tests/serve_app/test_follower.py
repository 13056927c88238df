"""serve_app.follower: applying deltas — only changed workers, names on membership change, epochs."""

from __future__ import annotations

from actors.models import Settings
from actors.protocol import RankMetrics, WorkerReport
from actors.registry import FleetRegistry
from serve_app.follower import FleetFollower


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


def test_a_full_snapshot_of_a_new_epoch_replaces_everything():
    old, new = FleetRegistry(Settings(), clock=Clock()), FleetRegistry(Settings(), clock=Clock())
    f = FleetFollower(_none)
    old.report(report("a"))
    f.apply(old.snapshot())
    new.report(report("b"))
    f.apply(new.snapshot())
    assert list(f.workers) == ["b"] and f.epoch == new.epoch
