"""actors.aggregator.registry / actors.models: worker states, versions, deltas, DP ranks — without Ray."""

from __future__ import annotations

import pytest

from actors.models import Settings, WorkerState, derive_state, sum_ranks, tokens_to_blocks
from actors.protocol import RankMetrics, WorkerReport, WorkerUpdate
from actors.aggregator.registry import FleetRegistry

S = Settings()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def rank(seq, *, active=2, waiting=0, kv=100, total=1000, rank=0, age=0.0):
    return RankMetrics(request_active_slots=active, request_total_slots=8, kv_active_blocks=kv, kv_total_blocks=total,
                       num_requests_waiting=waiting, gpu_cache_usage_perc=kv / total, gpu_prefix_cache_hit_rate=0.0,
                       data_parallel_rank=rank, age_s=age, seq=seq)


def batch(name="w1", *, healthy=True, ranks=None, inc="a"):
    return WorkerReport(name=name, url="http://127.0.0.1:1", page_size=16, incarnation=inc, healthy=healthy,
                        health_detail="ok", ranks=list((ranks or {}).values()))


def workers(reg) -> list[WorkerUpdate]:
    return reg.snapshot().workers


def metrics(w: WorkerUpdate):
    return sum_ranks([r.values() for r in w.ranks])


def test_state_is_down_when_health_fails_or_heartbeat_is_old_and_never_from_metric_age():
    assert derive_state(healthy=False, heartbeat_age_s=0, metrics_age_s=0, settings=S) is WorkerState.DOWN
    assert derive_state(healthy=True, heartbeat_age_s=S.down_after_s + 0.1, metrics_age_s=0, settings=S) is WorkerState.DOWN
    assert derive_state(healthy=True, heartbeat_age_s=0, metrics_age_s=10_000, settings=S) is WorkerState.IDLE
    assert derive_state(healthy=True, heartbeat_age_s=0, metrics_age_s=None, settings=S) is WorkerState.IDLE
    assert derive_state(healthy=True, heartbeat_age_s=0, metrics_age_s=0.1, settings=S) is WorkerState.LIVE


def test_tokens_become_blocks_rounding_up():
    assert tokens_to_blocks(0, 16) == 0
    assert tokens_to_blocks(1, 16) == 1
    assert tokens_to_blocks(32, 16) == 2
    assert tokens_to_blocks(33, 16) == 3


def test_registration_metrics_and_silence_walk_through_live_idle_down():
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    assert reg.report(batch())
    assert workers(reg)[0].state == "idle"  # healthy, never reported
    assert reg.report(batch(ranks={0: rank(1)}))
    assert workers(reg)[0].state == "live"
    clock.t += S.idle_after_s + 0.01
    reg.report(batch(ranks={0: rank(1)}))  # heartbeat with the same (old) metrics
    assert workers(reg)[0].state == "idle"
    clock.t += S.down_after_s + 0.01  # heartbeats stop
    assert reg.tick()
    assert workers(reg)[0].state == "down"


def test_unchanged_heartbeat_does_not_bump_the_version():
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    reg.report(batch(ranks={0: rank(1)}))
    v = reg.version
    clock.t += 0.1
    assert not reg.report(batch(ranks={0: rank(1, age=0.1)}))
    assert reg.version == v


def test_delta_carries_only_changed_workers_and_names_only_when_membership_changed():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch("a", ranks={0: rank(1)}))
    reg.report(batch("b", ranks={0: rank(1)}))
    first = reg.take_delta()
    assert sorted(w.name for w in first.workers) == ["a", "b"] and sorted(first.names) == ["a", "b"]
    assert reg.take_delta() is None  # nothing changed since
    assert reg.report(batch("b", ranks={0: rank(2, active=5)}))  # new ranks are a change
    reg.report(batch("b", ranks={0: rank(3, active=6)}))  # coalesced: one entry, the newest
    d = reg.take_delta()
    assert not d.full and d.prev_version == first.version and d.version == reg.version
    assert d.workers == []  # its ranks alone changed: a short metrics entry, not the whole record
    assert [m.name for m in d.metrics] == ["b"]
    assert metrics(d.metrics[0])["request_active_slots"] == 6
    assert d.names is None  # membership unchanged: no name list
    reg.report(batch("a", healthy=False, ranks={0: rank(2)}))
    d = reg.take_delta()
    assert [w.name for w in d.workers] == ["a"] and d.metrics == []  # more than ranks: the whole record
    assert d.workers[0].state == "down"


def test_snapshot_is_full_and_consistent_with_the_next_delta():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch("a"))
    reg.take_delta()
    reg.report(batch("b"))
    snap = reg.snapshot()
    assert snap.full and sorted(snap.names) == ["a", "b"] and snap.version == reg.version
    d = reg.take_delta()  # a follower at snap.version may apply it: prev_version <= its version
    assert d.prev_version <= snap.version <= d.version


def test_keepalive_is_empty_at_the_last_published_version():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch("a"))
    d = reg.take_delta()
    k = reg.keepalive()
    assert k.workers == [] and k.version == k.prev_version == d.version and k.epoch == reg.epoch


def test_health_failure_is_down_at_once():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch(ranks={0: rank(1)}))
    assert reg.report(batch(healthy=False, ranks={0: rank(1)}))
    assert workers(reg)[0].state == "down"


def test_metrics_age_comes_from_the_actor_receive_time():
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    reg.report(batch(ranks={0: rank(1, age=0.25)}))
    clock.t += 0.5
    assert workers(reg)[0].metrics_age_s == pytest.approx(0.75)


def test_dp_ranks_are_kept_apart_and_summed():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch(ranks={0: rank(1, active=1, kv=100, rank=0), 1: rank(2, active=3, kv=300, rank=1)}))
    w = workers(reg)[0]
    assert [r.data_parallel_rank for r in w.ranks] == [0, 1]
    assert metrics(w)["request_active_slots"] == 4
    assert metrics(w)["kv_active_blocks"] == 400
    assert metrics(w)["kv_total_blocks"] == 2000
    assert metrics(w)["gpu_cache_usage_perc"] == pytest.approx(0.2)


def test_sum_of_no_ranks_is_none():
    assert sum_ranks([]) is None


def test_new_incarnation_replaces_stale_ranks():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch(ranks={0: rank(5), 1: rank(6, rank=1)}, inc="old"))
    reg.report(batch(ranks={0: rank(1)}, inc="new"))
    assert len(workers(reg)[0].ranks) == 1


def test_removed_worker_disappears_from_names():
    reg = FleetRegistry(S, clock=Clock())
    reg.report(batch("a"))
    reg.take_delta()
    v = reg.version
    assert reg.remove("a")
    d = reg.take_delta()
    assert d.names == [] and d.workers == [] and reg.version > v
    assert not reg.remove("a")


def test_a_removed_workers_late_frames_do_not_bring_it_back_but_a_new_incarnation_does():
    """Frames its actor sent before it stopped, drained after the removal, would re-register it as a
    worker that stays down forever (its actor is gone)."""
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    reg.report(batch("a", ranks={0: rank(1)}, inc="first"))
    reg.take_delta()
    assert reg.remove("a")
    assert not reg.report(batch("a", ranks={0: rank(2)}, inc="first"))
    assert reg.names() == [] and reg.late_reports == 1
    assert reg.report(batch("a", ranks={0: rank(1)}, inc="second"))  # added again: a new actor
    assert reg.names() == ["a"]
    assert reg.remove("a") and reg.report(batch("a", inc="third"))  # each removal remembers its own


def test_removed_incarnations_are_bounded():
    from actors.aggregator import registry as r

    reg = FleetRegistry(S, clock=Clock())
    for i in range(r.MAX_REMOVED + 10):
        reg.report(batch(f"w{i}", inc="x"))
        reg.remove(f"w{i}")
    assert len(reg._removed) == r.MAX_REMOVED
    assert reg.report(batch("w0", inc="x"))  # the oldest forgotten: treated as new again


def test_router_in_flight_counts_are_shared_and_expire():
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    reg.report(batch("a"))
    assert reg.report_in_flight("replica-1", {"a": 4})
    assert workers(reg)[0].in_flight_by_replica == {"replica-1": 4}
    assert not reg.report_in_flight("replica-1", {"a": 4})
    clock.t += S.down_after_s * 2 + 0.1
    reg.report(batch("a"))
    reg.tick()
    assert workers(reg)[0].in_flight_by_replica == {}


def test_tick_skips_the_scan_until_a_threshold_is_due_and_still_walks_live_idle_down():
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    reg.report(batch("a", ranks={0: rank(1)}))
    reg.report(batch("b"))
    scans = []
    orig = reg._rederive
    reg._rederive = lambda w, now: scans.append(w.name) or orig(w, now)
    clock.t += 0.1
    assert not reg.tick() and scans == []  # nothing due: no per-worker work
    clock.t += S.idle_after_s  # a's metrics go stale, but heartbeats (down_after_s) went first
    assert reg.tick()
    states = {w.name: w.state for w in workers(reg)}
    assert states == {"a": "down", "b": "down"}
    scans.clear()
    clock.t += 10
    assert not reg.tick() and scans == []  # down stays down: nothing left to re-derive by time


def test_tick_turns_a_live_worker_idle_exactly_after_idle_after_s():
    clock = Clock()
    s = Settings(idle_after_s=1.0, down_after_s=5.0)
    reg = FleetRegistry(s, clock=clock)
    reg.report(batch(ranks={0: rank(1)}))
    clock.t += 0.99
    assert not reg.tick()
    clock.t += 0.02
    assert reg.tick()
    assert workers(reg)[0].state == "idle"


def test_the_aggregator_publishes_a_large_fleet_every_window_and_coalesces_a_small_one():
    from actors.aggregator.registry import publish_wait_s

    s = Settings(publish_interval_s=0.01, coalesce_s=0.05)
    # 1,000 workers × 10 Hz: ~100 frames per 10 ms window → every window (freshness kept)
    assert publish_wait_s(s, drained=100, elapsed_s=0.01, changed=True) == 0.01
    # 4 busy workers: ~1 frame per 10 ms, or ~5 per 50 ms → one delta per coalesce_s
    assert publish_wait_s(s, drained=1, elapsed_s=0.01, changed=True) == 0.05
    assert publish_wait_s(s, drained=5, elapsed_s=0.05, changed=True) == 0.05
    # the rule is a rate, not a count: 10 frames gathered over 50 ms is still a small fleet
    assert publish_wait_s(s, drained=10, elapsed_s=0.05, changed=True) == 0.05
    assert publish_wait_s(s, drained=40, elapsed_s=0.05, changed=True) == 0.01
    # heartbeats that changed nothing: drained every 5 windows whatever their number
    assert publish_wait_s(s, drained=2000, elapsed_s=0.05, changed=False) == 0.05


def test_next_due_is_the_earliest_threshold_a_tick_can_cross_a_worker_or_a_share():
    clock = Clock()
    reg = FleetRegistry(S, clock=clock)
    assert reg.next_due() == float("inf")  # nothing to watch: the aggregator's loop sleeps to its cap
    reg.report(batch("a", ranks={0: rank(1)}))
    t0 = clock.t
    assert reg.next_due() == t0 + S.down_after_s  # its heartbeat, before its idle threshold
    clock.t += 1.0
    reg.report(batch("a", ranks={0: rank(1)}))  # a heartbeat: the same values again
    assert reg.next_due() == t0 + S.down_after_s  # never later than the truth: no O(workers) work per report
    clock.t = t0 + S.down_after_s
    assert not reg.tick()  # nothing crossed: the heartbeat moved the threshold on
    assert reg.next_due() == t0 + 1.0 + S.down_after_s  # = its idle threshold too (t0 + 3)
    reg.report_in_flight("r1", {"a": 1})
    assert reg.next_due() == t0 + S.idle_after_s  # a share expires later (2 × down_after_s)
    clock.t = t0 + S.idle_after_s + 0.01
    reg.tick()  # crosses idle and the heartbeat's silence: down; nothing earlier than the share's expiry left
    assert reg.next_due() == t0 + S.down_after_s + 2 * S.down_after_s
