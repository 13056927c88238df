"""The in-flight ledger: what the router dispatched that the workers' reports can't show yet."""

from __future__ import annotations

import time

import pytest

from serve_app.ledger import Ledger, LedgerConfig, LedgerView
from serve_app.policies import WorkerView


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def counts(view: LedgerView) -> LedgerView:
    """The view's counts (when the worker was last routed to has its own test)."""
    return view._replace(last_routed_at=0.0)


@pytest.fixture
def ledger(clock: Clock) -> Ledger:
    return Ledger(LedgerConfig(report_latency_s=0.1, remote_ttl_s=2.0), replica_id="me", clock=clock)


def test_a_routed_request_counts_prefill_and_kv_until_it_ends(ledger):
    ledger.on_routed("r1", "w", prompt_blocks=40, cached_blocks=30)
    assert counts(ledger.view("w")) == LedgerView(in_flight=1, pending=1, pending_prefill_blocks=10,
                                          pending_kv_blocks=10, remote_pending=0, prefilling=1)
    ledger.on_first_token("r1")  # prefill done: KV stays held until the end
    assert counts(ledger.view("w")) == LedgerView(1, 1, 0, 10, 0)
    ledger.on_finished("r1")
    # gone, and counted as recently finished on w (its follow-up may come next)
    assert counts(ledger.view("w")) == LedgerView(0, 0, 0, 0, 0, recent_finished=1)


def test_the_view_says_when_this_replica_last_routed_to_the_worker(ledger, clock):
    assert ledger.view("w").last_routed_at == 0.0  # never
    ledger.on_routed("r1", "w", prompt_blocks=4)
    clock.t = 101.5
    ledger.on_routed("r2", "w", prompt_blocks=4)
    ledger.on_finished("r2")
    assert ledger.view("w").last_routed_at == 101.5  # kept after the request ends
    assert ledger.view("w", idle=True).last_routed_at == 101.5
    assert ledger.apply(WorkerView("w", "http://w", "live")).last_routed_at == 101.5


def test_failed_and_unknown_and_repeated_end_hooks_are_harmless(ledger):
    ledger.on_routed("r1", "w", 8)
    ledger.on_failed("r1")
    ledger.on_failed("r1")
    ledger.on_finished("r1")
    ledger.on_first_token("nope")
    ledger.on_finished("nope")
    assert counts(ledger.view("w")) == LedgerView(0, 0, 0, 0, 0)


def test_a_retry_with_the_same_id_moves_the_request_to_the_new_worker(ledger):
    ledger.on_routed("r1", "a", 8)
    ledger.on_routed("r1", "b", 8)
    assert ledger.in_flight("a") == 0 and ledger.in_flight("b") == 1


def test_a_report_absorbs_dispatches_routed_before_it_minus_latency(ledger, clock):
    ledger.on_routed("old", "w", 10)
    clock.t += 0.5
    ledger.on_routed("recent", "w", 20)
    clock.t += 0.05
    ledger.on_report("w", at=clock.t)  # "recent" is only 50 ms old: maybe not in the report yet
    v = ledger.view("w")
    assert v.in_flight == 2  # still in flight, both
    # pending: only "recent" is news to the report; prefill: both are before their first token
    assert (v.pending, v.pending_prefill_blocks, v.pending_kv_blocks) == (1, 30, 20)
    clock.t += 0.2
    ledger.on_report("w", at=clock.t)
    # both in the report now; their prefill still counts (a report never shows the work left)
    assert counts(ledger.view("w")) == LedgerView(2, 0, 30, 0, 0, prefilling_reported=2, prefilling=2)
    ledger.on_first_token("old")
    ledger.on_first_token("recent")
    assert counts(ledger.view("w")) == LedgerView(2, 0, 0, 0, 0)
    ledger.on_finished("old")
    ledger.on_finished("recent")
    # both are in the last report's figures: they stay "finished since" until a newer report
    assert counts(ledger.view("w")) == LedgerView(0, 0, 0, 0, 0, finished=2, finished_kv_blocks=30, recent_finished=2)
    clock.t += 0.01
    ledger.on_report("w", at=clock.t)
    assert counts(ledger.view("w")) == LedgerView(0, 0, 0, 0, 0, recent_finished=2)
    clock.t += 1.0  # past the follow-up window
    assert "w" in ledger.take_dirty()
    assert counts(ledger.view("w")) == LedgerView(0, 0, 0, 0, 0)


def test_requests_ending_after_the_report_leave_its_figures(clock):
    """SGLang reports every 40 decode steps: short requests end between reports, and until the
    next one the report would keep counting them (the "busy after a burst" view)."""
    ledger = Ledger(LedgerConfig(report_latency_s=0.1), block_tokens=16, clock=clock)
    for i in range(3):
        ledger.on_routed(f"r{i}", "w", 8)
        ledger.on_first_token(f"r{i}")  # decoding
    clock.t += 0.5
    ledger.on_report("w", at=clock.t)  # the report shows the three as running
    reported = WorkerView("w", "u", "live", page_size=16, running=3, total_slots=32, waiting=1,
                          kv_active_blocks=40, kv_total_blocks=768)
    assert ledger.apply(reported).running == 3
    ledger.on_finished("r0")
    ledger.on_finished("r1")
    v = ledger.apply(reported)
    assert (v.running, v.waiting, v.kv_active_blocks) == (1, 1, 24)
    ledger.on_finished("r2")
    ledger.on_routed("r3", "w", 8)  # not absorbed: pending as before
    v = ledger.apply(reported)
    assert (v.running, v.waiting, v.kv_active_blocks, v.pending) == (0, 1, 16, 1)
    # more ended than the report ran: the rest come out of its waiting count
    big = Ledger(LedgerConfig(report_latency_s=0.0), clock=clock)
    for i in range(3):
        big.on_routed(f"q{i}", "w", 1)
    clock.t += 0.1
    big.on_report("w", at=clock.t)
    for i in range(3):
        big.on_finished(f"q{i}")
    v = big.apply(WorkerView("w", "u", "live", running=1, waiting=2, kv_active_blocks=3))
    assert (v.running, v.waiting, v.kv_active_blocks) == (0, 0, 0)
    # an idle worker's report is not load anyway: zero, with nothing subtracted twice
    v = big.apply(WorkerView("w", "u", "idle", running=1, waiting=2, kv_active_blocks=3))
    assert (v.running, v.waiting, v.kv_active_blocks) == (0, 0, 0)
    # a newer report already excludes them
    clock.t += 0.01
    big.on_report("w", at=clock.t)
    assert big.apply(WorkerView("w", "u", "live", running=1, waiting=2)).running == 1


def test_reports_older_than_the_last_one_are_ignored(ledger, clock):
    ledger.on_routed("r", "w", 10)
    clock.t += 1
    ledger.on_report("w", at=clock.t - 0.5)
    assert ledger.view("w").pending == 0
    ledger.on_routed("r2", "w", 10)
    ledger.on_report("w", at=clock.t - 0.8)  # out of order: changes nothing
    assert ledger.view("w").pending == 1


def test_idle_worker_counts_every_in_flight_request_even_absorbed_ones(ledger, clock):
    ledger.on_routed("r1", "w", 10)
    ledger.on_routed("r2", "w", 6)
    ledger.on_first_token("r2")
    clock.t += 1
    ledger.on_report("w", at=clock.t)
    assert ledger.view("w").pending == 0
    assert counts(ledger.view("w", idle=True)) == LedgerView(2, 2, 10, 16, 0, prefilling=1)


def test_apply_zeroes_an_idle_workers_stale_report_but_keeps_capacity_and_in_flight(ledger):
    ledger.on_routed("r1", "w", 10)
    stale = WorkerView("w", "u", "idle", page_size=16, running=40, total_slots=48, waiting=7,
                       kv_active_blocks=9000, kv_total_blocks=10000)
    v = ledger.apply(stale)
    assert (v.running, v.waiting, v.kv_active_blocks) == (0, 0, 0)
    assert (v.total_slots, v.kv_total_blocks) == (48, 10000)
    assert (v.in_flight, v.pending, v.pending_kv_blocks) == (1, 1, 10)
    live = ledger.apply(WorkerView("w", "u", "live", running=40, waiting=7))
    assert (live.running, live.waiting, live.pending) == (40, 7, 1)


def test_export_shares_only_what_reports_do_not_show(ledger, clock):
    ledger.on_routed("a", "w1", 4)
    ledger.on_routed("b", "w2", 4)
    clock.t += 1
    ledger.on_report("w1", at=clock.t)
    ledger.on_routed("c", "w2", 4)
    assert ledger.export() == {"w2": 2}


def test_remote_counts_add_up_replace_per_replica_and_expire(ledger, clock):
    ledger.merge_remote("r2", {"w": 3}, at=clock.t)
    ledger.merge_remote("r3", {"w": 2, "x": 1}, at=clock.t)
    assert ledger.view("w").remote_pending == 5
    ledger.merge_remote("r2", {"w": 1}, at=clock.t)  # a newer export replaces the old one
    assert ledger.view("w").remote_pending == 3
    ledger.merge_remote("me", {"w": 100}, at=clock.t)  # our own broadcast coming back
    assert ledger.view("w").remote_pending == 3
    clock.t += 1.5
    ledger.merge_remote("r2", {"w": 1}, at=clock.t)
    clock.t += 1.0  # r3 silent for 2.5 s > ttl
    ledger.expire_remote()
    assert ledger.view("w").remote_pending == 1 and ledger.view("x").remote_pending == 0


def test_take_dirty_names_the_workers_whose_figures_changed(ledger, clock):
    ledger.on_routed("a", "w1", 4)
    ledger.merge_remote("r2", {"w3": 1}, at=clock.t)
    assert ledger.take_dirty() == {"w1", "w3"}
    assert ledger.take_dirty() == set()
    ledger.on_first_token("a")
    assert ledger.take_dirty() == {"w1"}


def test_requests_never_finished_are_forgotten_after_max_age(clock):
    ledger = Ledger(LedgerConfig(max_request_age_s=60), clock=clock)
    ledger.on_routed("lost", "w", 10)
    clock.t += 61
    ledger.on_routed("new", "w", 10)
    assert ledger.in_flight("w") == 1 and ledger.forgotten == 1


def test_remove_worker_forgets_it(ledger):
    ledger.on_routed("a", "w", 4)
    ledger.remove_worker("w")
    assert counts(ledger.view("w")) == LedgerView(0, 0, 0, 0, 0)
    ledger.on_finished("a")  # a late end hook is harmless
    assert ledger.in_flight("w") == 0


def test_a_worker_that_never_reports_keeps_bounded_state_and_fast_events(ledger, clock):
    start = time.perf_counter()
    for i in range(20_000):
        clock.t += 0.001
        ledger.on_routed(f"r{i}", "silent", 8)
        ledger.on_first_token(f"r{i}")
        ledger.on_finished(f"r{i}")
    per_request_us = (time.perf_counter() - start) / 20_000 * 1e6
    v = ledger.view("silent")
    assert v[:7] == (0, 0, 0, 0, 0, 0, 0) and v.recent_finished <= 1001  # one window of finishes
    assert len(ledger._workers["silent"].queue) <= 64 + 1  # compacted, not 20k entries
    assert len(ledger._workers["silent"].recent) <= 1001
    assert per_request_us < 100


def test_a_long_prefill_keeps_counting_after_a_report_absorbs_it(clock):
    """A report produced while a 2k-token prompt is prefilling shows it as a slot (or a waiting
    request) and its KV, not as the ~120 ms of prefill left: the ledger keeps the prefill until the
    first token, and takes it out of the report's waiting count instead of counting it twice."""
    ledger = Ledger(LedgerConfig(report_latency_s=0.1), block_tokens=16, clock=clock)
    ledger.on_routed("a", "w", 128)
    ledger.on_routed("b", "w", 128)
    clock.t += 0.5
    ledger.on_report("w", at=clock.t)
    reported = WorkerView("w", "u", "live", page_size=16, running=1, total_slots=32, waiting=2,
                          kv_active_blocks=128, kv_total_blocks=768)
    v = ledger.apply(reported)
    assert (v.pending, v.pending_prefill_blocks, v.pending_kv_blocks) == (0, 256, 0)
    assert (v.running, v.waiting) == (1, 0)  # a and b are ours: waiting keeps only another client's
    ledger.on_first_token("a")
    v = ledger.apply(reported)
    assert (v.pending_prefill_blocks, v.waiting) == (128, 1)
    ledger.on_failed("b")  # broke before its first token: its prefill leaves with it
    v = ledger.apply(reported)
    assert v.pending_prefill_blocks == 0 and v.running + v.waiting == 2  # a + the other client's
    assert ledger.view("w").prefilling_reported == 0


def test_snapshot_counts_per_worker_and_per_replica_share_one_store(ledger, clock):
    ledger.set_remote("w", {"r2": 3, "r3": 2, "me": 7})  # our own count in the snapshot is ignored
    ledger.set_remote("x", {"r2": 1})
    assert (ledger.view("w").remote_pending, ledger.view("x").remote_pending) == (5, 1)
    ledger.merge_remote("r2", {"w": 1}, at=clock.t)  # a replica's whole export replaces its counts
    assert (ledger.view("w").remote_pending, ledger.view("x").remote_pending) == (3, 0)
    ledger.set_remote("w", {"r3": 2})  # r2 no longer counts anything on w
    assert ledger.view("w").remote_pending == 2
    ledger.take_dirty()
    ledger.set_remote("w", {"r3": 2})  # unchanged: nothing to refresh
    assert ledger.take_dirty() == set()
    clock.t += 1.5
    ledger.refresh_remote()  # still in the snapshot: re-dated, survives the TTL
    clock.t += 1.0
    assert ledger.view("w").remote_pending == 2
    ledger.take_dirty()  # (expires what is due)
    assert ledger.view("w").remote_pending == 2
    clock.t += 2.5  # not re-dated since: dropped
    ledger.take_dirty()
    assert ledger.view("w").remote_pending == 0
