"""RouterCore — the router replica's decision plane without Serve or HTTP — fed by hand."""

from __future__ import annotations

from collections import Counter
from typing import Any

from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.router import RouterCore
from tests.serve_app.support import Clock
from tests.serve_app.support import unused_aggregator as _unused


def make_core(n: int, *, kv_total_pages: int = 4096, **router: Any) -> tuple[RouterCore, Clock]:
    clock = Clock()
    core = RouterCore(RouterConfig(**router), FleetFollower(_unused), "r0", clock=clock)
    for i in range(n):
        report(core, clock, f"w{i}", kv_total_blocks=kv_total_pages)
    return core, clock


def report(core: RouterCore, clock: Clock, name: str, in_flight_by_replica: dict[str, int] | None = None,
           **metrics: Any) -> None:
    m = dict(request_active_slots=0, request_total_slots=64, kv_active_blocks=0, kv_total_blocks=4096,
             num_requests_waiting=0, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0,
             data_parallel_rank=0)
    m.update(metrics)
    core.follower.workers[name] = WorkerRecord(name=name, url=f"http://{name}", page_size=16, state="live",
                                               healthy=True, metrics=m, metrics_at=clock.t, heartbeat_at=clock.t,
                                               in_flight_by_replica=in_flight_by_replica or {})
    core.on_fleet_update([name])


def chat(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": question}]}


def route(core: RouterCore, clock: Clock, body: dict, rid: str) -> str:
    clock.t += 0.001
    d, facts = core.decide(core.facts(body))
    core.on_routed(rid, facts, d.worker)
    return d.worker


def test_the_ledger_charges_only_the_blocks_the_worker_must_still_prefill():
    core, clock = make_core(2)
    system = "You are a careful assistant. " * 400
    first = route(core, clock, chat(system, "question one"), "a")
    full = core.ledger.view(first).pending_prefill_blocks
    second = route(core, clock, chat(system, "question two"), "b")
    assert second == first  # affinity
    # the second request's system prompt is (believed) cached there: it adds its tail only
    added = core.ledger.view(first).pending_prefill_blocks - full
    assert 0 < added <= 2, (full, added)


def test_prefix_and_ledger_are_recorded_when_the_request_is_dispatched():
    core, clock = make_core(2)
    body = chat("shared " * 2000, "q")
    w = route(core, clock, body, "a")
    d, facts = core.decide(core.facts(body))  # before the worker answered anything
    assert facts.overlap.get(w, 0) >= facts.prompt_blocks - 1 and d.worker == w


def test_hot_prefixes_reach_the_views_and_cold_groups_do_not_pile_onto_a_full_cache():
    """8 groups with long system prompts on 4 workers whose caches hold about two each: every
    worker ends up with two groups — a third one on a worker would evict a reused prefix."""
    core, clock = make_core(4, kv_total_pages=500)
    owner: dict[int, Counter] = {}
    for g in range(8):
        system = f"group {g} " + "lorem ipsum dolor sit amet " * 480  # ~3.2k tokens, ~200 blocks
        owner[g] = Counter()
        for k in range(2):  # twice each, one after the other: the second makes the prefix hot
            rid = f"g{g}-{k}"
            owner[g][route(core, clock, chat(system, f"question {k}"), rid)] += 1
            core.ledger.on_first_token(rid)
            core.ledger.on_finished(rid)
    assert all(len(c) == 1 for c in owner.values()), owner  # each group stayed on its worker
    per_worker = Counter(next(iter(c)) for c in owner.values())
    assert sorted(per_worker.values()) == [2, 2, 2, 2], per_worker
    views = {v.name: v for v in core.views()}
    assert all(v.hot_blocks > 300 for v in views.values()), {n: v.hot_blocks for n, v in views.items()}


def test_requests_that_ended_since_the_last_report_are_not_load():
    core, clock = make_core(2)
    for i in range(3):
        route(core, clock, chat(f"unique {i} " * 50, "q"), f"r{i}")
    clock.t += 0.5
    busy = {v.name: v.running for v in core.views()}
    for name in busy:  # each worker reports what it was sent as running
        n = sum(1 for r in core.ledger._reqs.values() if r.worker == name)
        report(core, clock, name, request_active_slots=n, kv_active_blocks=40 * n)
    before = {v.name: v.running for v in core.views()}
    assert sum(before.values()) == 3
    for i in range(3):
        core.ledger.on_finished(f"r{i}")
    after = {v.name: (v.running, v.kv_active_blocks) for v in core.views()}
    assert all(r == 0 for r, _ in after.values()), after


def test_the_decision_log_holds_every_decision_with_each_candidates_view(tmp_path):
    import json

    from serve_app.router import DECISION_LOG_COLUMNS

    path = tmp_path / "decisions.jsonl"
    core, clock = make_core(2, decision_log=str(path))
    report(core, clock, "w1", num_requests_waiting=3)
    first = route(core, clock, chat("sys " * 50, "q1"), "r1")
    route(core, clock, chat("sys " * 50, "q2"), "r2")
    lines = [json.loads(x) for x in path.read_text().splitlines()]  # nothing held back in a buffer
    assert len(lines) == 2
    assert lines[0]["worker"] == first and lines[0]["reason"]
    cand = {w: dict(zip(DECISION_LOG_COLUMNS, v)) for w, v in lines[0]["w"].items()}
    assert set(cand) == {"w0", "w1"} and cand["w1"]["waiting"] == 3 and cand["w1"]["state"] == "live"
    second = {w: dict(zip(DECISION_LOG_COLUMNS, v)) for w, v in lines[1]["w"].items()}
    assert second[first]["in_flight"] == 1 and second[first]["prefilling"] == 1  # r1, before its first token


# -- the per-request ticket -------------------------------------------------------------------


def test_a_ticket_books_the_request_and_ends_it_once():
    core, clock = make_core(2)
    ticket = core.route(core.facts(chat("sys " * 300, "q")))
    w = ticket.worker
    assert ticket.decision.policy == "kv_aware" and ticket.url == f"http://{w}"
    assert ticket.request.prompt_blocks > 0
    view = core.ledger.view(w)
    assert (view.in_flight, view.prefilling) == (1, 1)
    assert view.pending_prefill_blocks == ticket.request.prompt_blocks  # nothing cached there yet
    ticket.first_token()
    view = core.ledger.view(w)
    assert (view.in_flight, view.prefilling, view.pending_prefill_blocks) == (1, 0, 0)
    ticket.finished()
    ticket.failed()  # a second end (e.g. from a finally block) is ignored
    assert core.ledger.view(w).in_flight == 0 and core.ledger.view(w).recent_finished == 1
    # the prompt was indexed where it went: the next one with that prefix follows it
    assert core.route(core.facts(chat("sys " * 300, "another q"))).worker == w


def test_a_failed_ticket_frees_its_worker_and_a_retry_excludes_it():
    core, clock = make_core(2)
    body = chat("sys " * 300, "q")
    first = core.route(core.facts(body))
    first.failed()
    assert core.ledger.view(first.worker).in_flight == 0 and core.ledger.view(first.worker).recent_finished == 0
    retry = core.route(core.facts(body), exclude={first.worker})
    assert retry.worker != first.worker and retry.request_id != first.request_id
    assert core.ledger.in_flight(retry.worker) == 1


def test_the_kv_follower_is_built_around_the_cores_exact_index():
    built = []

    def make(index: Any) -> Any:
        built.append(index)
        return type("Follower", (), {"synced": set(), "ensure": lambda *a: None, "drop": lambda *a: None})()

    core = RouterCore(RouterConfig(), FleetFollower(_unused), "r0", kv_follower=make)
    assert built == [core.exact] and core.kv_follower is not None


# -- other replicas' in-flight counts ---------------------------------------------------------


def test_other_replicas_counts_come_from_the_snapshot_and_are_kept_once():
    core, clock = make_core(2)
    report(core, clock, "w0", in_flight_by_replica={"r1": 3, "r2": 1, "r0": 9})  # r0: our own, ignored
    report(core, clock, "w1", in_flight_by_replica={"r1": 2})
    views = {v.name: v for v in core.views()}
    assert (views["w0"].remote_pending, views["w1"].remote_pending) == (4, 2)
    report(core, clock, "w0", in_flight_by_replica={"r2": 5})  # r1 finished its requests on w0
    views = {v.name: v for v in core.views()}
    assert (views["w0"].remote_pending, views["w1"].remote_pending) == (5, 2)
    # counts the snapshot still shows survive the ledger's TTL when re-dated; a silent replica's go
    for _ in range(3):
        clock.t += core.ledger.config.remote_ttl_s * 0.6
        core.refresh_remote()
    assert {v.name: v.remote_pending for v in core.views()} == {"w0": 5, "w1": 2}
    del core.follower.workers["w1"]
    core.on_fleet_update(["w1"])  # w1 left: r1's only count goes with it
    assert {v.name: v.remote_pending for v in core.views()} == {"w0": 5}
    assert core.ledger.view("w1").remote_pending == 0
    clock.t += core.ledger.config.remote_ttl_s + 1  # nothing re-dated them: the replicas are gone
    assert {v.name: v.remote_pending for v in core.views()} == {"w0": 0}


def test_excluded_workers_are_never_chosen_and_the_fleet_view_is_left_as_it_was():
    import pytest

    from serve_app.policies.base import NoWorkerAvailable

    core, clock = make_core(3)
    report(core, clock, "w1", kv_total_blocks=4096, request_active_slots=0)  # w1 is the cheapest...
    report(core, clock, "w0", request_active_slots=30)
    report(core, clock, "w2", request_active_slots=30)
    before = list(core.views())
    picks = {core.route(core.facts(chat(f"s{i} " * 50, "q")), exclude={"w1"}).worker for i in range(20)}
    assert picks <= {"w0", "w2"} and picks
    assert [v.state for v in core.views()] == [v.state for v in before] == ["live"] * 3
    with pytest.raises(NoWorkerAvailable, match="all 3 are excluded"):
        core.decide(core.facts(chat("s", "q")), exclude={"w0", "w1", "w2", "gone"})


def test_the_in_flight_share_is_this_replicas_pending_counts():
    core, clock = make_core(2)
    assert core.in_flight_share() == {}
    ticket = core.route(core.facts(chat("sys " * 100, "q")))
    assert core.in_flight_share() == {ticket.worker: 1}
    ticket.finished()
    assert core.in_flight_share() == {}


def test_a_replica_has_peers_when_the_aggregator_names_another_and_they_are_active_while_they_route():
    core, clock = make_core(2)  # replica "r0"
    assert core.peers(2.0) == (False, False)
    core.follower.replicas = frozenset({"r0"})  # only itself shares
    assert core.peers(2.0) == (False, False)
    core.follower.replicas = frozenset({"r1"})  # another one, before our own first share is named
    assert core.peers(2.0) == (True, False)  # present, but no counts of it seen: idle
    core.follower.replicas = frozenset({"r0", "r1"})
    report(core, clock, "w0", in_flight_by_replica={"r0": 2})  # only our own counts: still idle
    assert core.peers(2.0) == (True, False)
    report(core, clock, "w1", in_flight_by_replica={"r1": 1})  # r1 has requests in flight
    assert core.peers(2.0) == (True, True)
    clock.t += 2.5
    assert core.peers(2.0) == (True, False)  # not seen lately
    core.follower.replicas = frozenset({"r0"})
    report(core, clock, "w1", in_flight_by_replica={"r1": 1})
    assert core.peers(2.0) == (False, False)  # gone from the aggregator: not a peer, whatever its stale counts


def test_a_prefix_pushed_out_by_newer_prompts_is_charged_as_a_full_prefill():
    """A prompt sent to a worker long ago, with more than its KV pool of other prompts sent there
    since, still draws the prompt back there (an engine may keep an old prefix's first blocks), but
    the ledger charges its full prefill: the next requests see it ahead of them instead of stacking
    behind it (the tail of bench/results/standard-mooncake-7.md came from exactly that belief)."""

    def run(pages: int, **router: Any) -> tuple[int, int, int]:
        # 64 pages of 16 tokens = 1,024 tokens = 64 router blocks of 16 tokens (4 chars each)
        core, clock = make_core(1, kv_total_pages=pages, **router)
        big = chat("A long shared document. " * 80, "first")  # ~2,000 chars ≈ 31 blocks
        route(core, clock, big, "r0")
        core.ledger.on_finished("r0")
        for i in range(2):  # 2 × ~31 blocks of unrelated prompts: with the first, more than 64
            route(core, clock, chat(f"Unrelated text number {i}. " * 80, "q"), f"u{i}")
            core.ledger.on_finished(f"u{i}")
        facts = core.facts(big)
        held = core.prefix.held_blocks("w0", facts.block_hashes)
        route(core, clock, big, "again")
        return facts.prompt_blocks, held, core.ledger.view("w0").pending_prefill_blocks

    blocks, held, charged = run(64)
    # ~93 blocks sent into 64: the LRU cache kept only its first 2 blocks; the rest is prefilled again
    assert blocks >= 28 and held <= 2 and charged >= blocks - 2
    blocks, held, charged = run(64, prefix_index={"cache_share": 0})  # ttl only: believed cached
    assert held >= 28 and charged <= 2
    blocks, held, charged = run(256)  # a worker reporting a bigger pool keeps it
    assert held >= 28 and charged <= 2
