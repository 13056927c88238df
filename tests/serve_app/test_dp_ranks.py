"""DP-attention ranks (issue 19, item 2): each rank of a worker with dp_size > 1 is a routing target
of its own — load, prefix (approximate and exact) and the in-flight ledger per rank — behind the one
policy interface, and the forwarded request pins the chosen rank as sglang-router --dp-aware does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from actors.fleet import FleetError, parse_fleet
from actors.models import sum_ranks
from actors.worker.launcher import build_command
from serve_app.config import RouterConfig
from serve_app.dp_ranks import pinned_body, pinned_headers
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.prefix_index import hash_token_blocks
from serve_app.router import RouterCore
from tests.serve_app.support import Clock
from tests.serve_app.support import unused_aggregator as _unused
from tests.serve_app.test_prefix_index import engine_events

_IDLE = dict(request_active_slots=0, request_total_slots=64, kv_active_blocks=0, kv_total_blocks=4096,
             num_requests_waiting=0, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0)


def rank_metrics(rank: int, **m: Any) -> dict[str, Any]:
    return {**_IDLE, **m, "data_parallel_rank": rank}


def report(core: RouterCore, clock: Clock, name: str, ranks: list[dict[str, Any]], dp_size: int,
           state: str = "live", models: list[str] | None = None, in_flight_by_replica: dict[str, int] | None = None):
    summed = (dict(ranks[0]) if len(ranks) == 1 else sum_ranks(ranks)) if ranks else None
    core.follower.workers[name] = WorkerRecord(
        name=name, url=f"http://{name}", page_size=16, state=state, healthy=True, metrics=summed, ranks=ranks,
        metrics_at=clock.t, heartbeat_at=clock.t, dp_size=dp_size, models=models or [],
        rank_at={r["data_parallel_rank"]: clock.t for r in ranks}, in_flight_by_replica=in_flight_by_replica or {})
    core.on_fleet_update([name])


def make_core(**router: Any) -> tuple[RouterCore, Clock]:
    clock = Clock()
    return RouterCore(RouterConfig(**router), FleetFollower(_unused), "r0", clock=clock), clock


def chat(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_each_rank_is_a_target_with_its_own_reported_load():
    core, clock = make_core()
    report(core, clock, "d", [rank_metrics(0, request_active_slots=7), rank_metrics(1, num_requests_waiting=3)], 2)
    views = {v.name: v for v in core.views()}
    assert set(views) == {"d@0", "d@1"}
    assert (views["d@0"].worker, views["d@0"].rank, views["d@0"].running, views["d@0"].waiting) == ("d", 0, 7, 0)
    assert (views["d@1"].worker, views["d@1"].rank, views["d@1"].running, views["d@1"].waiting) == ("d", 1, 0, 3)
    assert core.targets("d") == ("d@0", "d@1")


@pytest.mark.parametrize("policy", ["kv_aware", "least_loaded", "power_of_two"])
def test_a_busy_rank_is_avoided(policy):
    core, clock = make_core(policy=policy)
    report(core, clock, "d", [rank_metrics(0, request_active_slots=60, num_requests_waiting=20,
                                           kv_active_blocks=3000), rank_metrics(1)], 2)
    for i in range(10):
        d, _ = core.decide(core.facts(chat(f"s{i} " * 40, "q")))
        assert (d.worker, d.rank, d.target, d.url) == ("d", 1, "d@1", "http://d")


def test_a_rank_not_heard_from_yet_is_routable_with_no_reported_load():
    core, clock = make_core(policy="least_loaded")
    report(core, clock, "d", [rank_metrics(0, request_active_slots=5)], 2)  # rank 1 has not reported
    d, _ = core.decide(core.facts(chat("s", "q")))
    assert d.rank == 1


def test_the_rank_holding_the_prefix_is_preferred_and_the_ledger_books_per_rank():
    core, clock = make_core()
    report(core, clock, "d", [rank_metrics(0), rank_metrics(1)], 2)
    system = "You are a careful assistant. " * 300
    first = core.route(core.facts(chat(system, "one")))
    assert first.decision.rank in (0, 1)
    assert core.ledger.in_flight(first.decision.target) == 1
    assert core.ledger.in_flight(f"d@{1 - first.decision.rank}") == 0
    for q in ("two", "three", "four"):
        clock.t += 0.01
        t = core.route(core.facts(chat(system, q)))
        assert t.decision.target == first.decision.target, t.decision.reason  # the prefix's rank
    assert core.in_flight("d") == 4
    w = core.workers_json()["workers"][0]
    assert w["dp_size"] == 2 and w["in_flight"] == 4
    assert sorted(w["in_flight_by_rank"]) == [0, 4]


def test_round_robin_spreads_over_every_rank_of_every_worker():
    core, clock = make_core(policy="round_robin")
    report(core, clock, "d", [rank_metrics(0), rank_metrics(1)], 2)
    report(core, clock, "e", [rank_metrics(0)], 1)
    seen = [core.decide(core.facts(chat("s", "q")))[0] for _ in range(6)]
    assert [(d.worker, d.rank) for d in seen] == [("d", 0), ("d", 1), ("e", None)] * 2


def test_exact_kv_events_count_for_the_rank_that_cached_them():
    core, clock = make_core(block_size=4)
    report(core, clock, "d", [rank_metrics(0), rank_metrics(1)], 2)
    report(core, clock, "e", [rank_metrics(0)], 1)
    toks = list(range(100, 132))
    core.exact.apply("d", engine_events(toks, 4), rank=1)
    core.exact.apply("e", engine_events(toks[:8], 4), rank=0)
    assert core.exact.overlap(hash_token_blocks(toks, 4)).as_dict() == {"d@1": 8, "e": 2}
    core.exact.clear("d")
    assert core.exact.overlap(hash_token_blocks(toks, 4)).as_dict() == {"e": 2}


def test_excluding_a_worker_hides_all_its_ranks():
    core, clock = make_core()
    report(core, clock, "d", [rank_metrics(0), rank_metrics(1)], 2)
    report(core, clock, "e", [rank_metrics(0, request_active_slots=40)], 1)
    picks = {core.decide(core.facts(chat(f"s{i}", "q")), exclude={"d"})[0].worker for i in range(10)}
    assert picks == {"e"}
    assert [v.state for v in core.views()] == ["live"] * 3


def test_a_worker_leaving_takes_its_ranks_and_a_changed_dp_size_replaces_them():
    core, clock = make_core()
    report(core, clock, "d", [rank_metrics(0), rank_metrics(1)], 2)
    report(core, clock, "d", [rank_metrics(r) for r in range(3)], 3)
    assert [v.name for v in core.views()] == ["d@0", "d@1", "d@2"]
    report(core, clock, "d", [rank_metrics(0)], 1)
    assert [(v.name, v.rank) for v in core.views()] == [("d", None)]
    del core.follower.workers["d"]
    core.on_fleet_update(["d"])
    assert list(core.views()) == []


def test_other_replicas_counts_are_spread_over_the_ranks():
    core, clock = make_core()
    report(core, clock, "d", [rank_metrics(0), rank_metrics(1)], 2, in_flight_by_replica={"r9": 3})
    assert sorted(v.remote_pending for v in core.views()) == [1, 2]


def test_only_the_models_dp_workers_ranks_are_candidates():
    core, clock = make_core()
    report(core, clock, "a", [rank_metrics(0), rank_metrics(1)], 2, models=["A"])
    report(core, clock, "b", [rank_metrics(0), rank_metrics(1)], 2, models=["B"])
    got = {(d.worker, d.rank) for d in (core.decide(core.facts(chat(f"s{i}", "q")), model="B")[0]
                                         for i in range(20))}
    assert got == {("b", 0), ("b", 1)}


def test_the_forwarded_body_pins_the_rank_as_sglang_router_dp_aware_does():
    body = {"model": "m", "messages": [], "routed_dp_rank": 0, "data_parallel_rank": 0}
    assert json.loads(pinned_body(body, 1)) == {**body, "data_parallel_rank": 1, "routed_dp_rank": 1}
    assert json.loads(pinned_body({"text": "hi"}, 3)) == {"text": "hi", "data_parallel_rank": 3}
    assert pinned_headers({"X-Data-Parallel-Rank": "0", "x-override-routed-dp-rank": "0", "a": "b"}) == {"a": "b"}


def test_fleet_dp_size_is_validated_and_reaches_the_engine():
    spec = parse_fleet({"workers": [{"name": "d", "engine": "sim", "dp_size": 4}]})
    w = spec.workers[0]
    assert w.dp_size == 4 and w.kv_event_ranks == 4
    cmd, _ = build_command(w, host="127.0.0.1", port=1, metrics_endpoint="ipc:///tmp/x")
    assert cmd[cmd.index("--dp-size") + 1] == "4"
    assert parse_fleet({"workers": [{"name": "d", "url": "http://h:1", "metrics_endpoint": "tcp://10.0.0.1:5"}]}
                       ).workers[0].dp_size == 1
    with pytest.raises(FleetError, match=r"dp_size"):
        parse_fleet({"workers": [{"name": "d", "engine": "sim", "dp_size": 0}]})
    with pytest.raises(FleetError, match=r"engine_args.dp_size=2: set the entry's dp_size"):
        parse_fleet({"workers": [{"name": "d", "engine": "sim", "engine_args": {"dp_size": 2}}]})
    same = parse_fleet({"workers": [{"name": "d", "engine": "sglang", "model": "x", "dp_size": 2,
                                     "engine_args": {"dp_size": 2, "enable_dp_attention": True}}]}).workers[0]
    cmd, _ = build_command(same, host="127.0.0.1", port=1, metrics_endpoint="ipc:///tmp/x")
    assert cmd.count("--dp-size") == 1 and "--enable-dp-attention" in cmd


def test_the_demo_fleet_can_run_dp_workers():
    from serve_app.cli import build_parser, demo_fleet

    assert build_parser().parse_args(["demo", "--dp-size", "2"]).dp_size == 2
    assert [w.dp_size for w in demo_fleet(2, tmpdir="/tmp/kvroute-test", dp_size=2).workers] == [2, 2]


def test_dp_ranks_on_pd_workers_are_accepted_and_an_old_sim_wire_is_refused():
    spec = parse_fleet({"workers": [
        {"name": "p", "engine": "sim", "dp_size": 2, "role": "prefill", "bootstrap_port": 8998},
        {"name": "d", "engine": "sim", "dp_size": 4, "role": "decode"}]})
    assert [(w.role, w.dp_size) for w in spec.workers] == [("prefill", 2), ("decode", 4)]
    # a simulated SGLang release that reads neither routed_dp_rank nor disagg_prefill_dp_rank
    with pytest.raises(FleetError, match=r"worker 'd'.*dp_size > 1 with role: decode needs .*0\.5\.14.*0\.4\.9"):
        parse_fleet({"workers": [{"name": "d", "engine": "sim", "dp_size": 2, "role": "decode",
                                  "engine_args": {"wire": "0.4.9"}}]})
