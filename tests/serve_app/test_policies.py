"""Routing policies: the registry, never-down, tie-breaking, and kv_aware's balance of affinity and load."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from itertools import count

import pytest

from serve_app.ledger import Ledger
from serve_app.policies import (
    DEFAULT_POLICY,
    POLICIES,
    KvAware,
    KvAwareConfig,
    NoWorkerAvailable,
    RouteRequest,
    UnknownPolicy,
    WorkerView,
    get_policy,
)
from serve_app.prefix_index import PrefixIndex
from serve_app.request_facts import facts_from_body

ALL = sorted(POLICIES)


def worker(name: str, state: str = "live", **kw) -> WorkerView:
    base = dict(page_size=16, total_slots=16, kv_total_blocks=4096)
    base.update(kw)
    return WorkerView(name, f"http://{name}", state, **base)


def fleet(n: int, **kw) -> list[WorkerView]:
    return [worker(f"w{i}", **kw) for i in range(n)]


def req(tokens: int = 1024, overlap: dict[str, int] | None = None) -> RouteRequest:
    return RouteRequest(prompt_tokens=tokens, block_tokens=16, overlap=overlap or {})


class Router:
    """The router's decision loop, minus I/O: ledger → views, index → overlap, policy, bookkeeping."""

    def __init__(self, policy: str, views: list[WorkerView], seed: int = 0) -> None:
        self.policy = get_policy(policy)
        self.views = views
        self.rng = random.Random(seed)
        self.t = 0.0
        self.ledger = Ledger(clock=lambda: self.t)
        self.index = PrefixIndex(clock=lambda: self.t)
        self.ids = count()

    def route(self, body: dict) -> tuple[str, str]:
        self.t += 0.001
        r = facts_from_body(body)
        ov = self.index.overlap(r.block_hashes)
        r = r.with_overlap(ov)
        d = self.policy.choose(r, [self.ledger.apply(v) for v in self.views], self.rng)
        rid = f"r{next(self.ids)}"
        self.ledger.on_routed(rid, d.worker, r.prompt_blocks, ov.get(d.worker, 0))
        self.index.record(d.worker, r.block_hashes)
        return d.worker, rid


def chat(*contents: str) -> dict:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}


# -- registry -------------------------------------------------------------------------------


def test_registry_names_the_five_policies_and_defaults_to_kv_aware():
    assert set(POLICIES) == {"round_robin", "random", "power_of_two", "least_loaded", "kv_aware"}
    assert DEFAULT_POLICY == "kv_aware"
    for name in ALL:
        assert get_policy(name).name == name


def test_unknown_policy_error_lists_the_valid_names():
    with pytest.raises(UnknownPolicy) as e:
        get_policy("cache_aware")
    assert isinstance(e.value, ValueError)
    assert "cache_aware" in str(e.value)
    for name in ALL:
        assert name in str(e.value)


# -- every policy ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_no_policy_ever_picks_a_down_worker(name):
    ws = [worker("up1"), worker("dead", "down"), worker("up2", "idle"), worker("dead2", "down")]
    # make the down ones look like the best choice by every other measure
    ws = [replace(w, running=0) if w.state == "down" else replace(w, running=9, waiting=5) for w in ws]
    policy = get_policy(name)
    picks = {policy.choose(req(overlap={"dead": 64}), ws, random.Random(s)).worker for s in range(200)}
    assert picks <= {"up1", "up2"} and picks


@pytest.mark.parametrize("name", ALL)
def test_all_down_or_empty_fleet_raises_no_worker_available(name):
    with pytest.raises(NoWorkerAvailable, match="w0=down"):
        get_policy(name).choose(req(), [worker("w0", "down")], random.Random(0))
    with pytest.raises(NoWorkerAvailable, match="no workers registered"):
        get_policy(name).choose(req(), [], random.Random(0))


@pytest.mark.parametrize("name", ["random", "least_loaded", "power_of_two", "kv_aware"])
def test_ties_are_broken_uniformly_at_random(name):
    ws = fleet(4)
    counts = Counter(get_policy(name).choose(req(), ws, random.Random(s)).worker for s in range(800))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert all(140 <= c <= 260 for c in counts.values()), counts


def test_kv_aware_breaks_ties_at_random_on_large_fleets_too():
    from serve_app.policies.fleet import FleetView

    fv = FleetView(fleet(100))
    picks = Counter(KvAware().choose(req(), fv, random.Random(s)).worker for s in range(1000))
    assert len(picks) > 90 and max(picks.values()) < 30


def test_round_robin_cycles_in_fleet_order_skipping_down_workers():
    rr = get_policy("round_robin")
    ws = [worker("a"), worker("b", "down"), worker("c"), worker("d", "idle")]
    picks = [rr.choose(req(), ws, random.Random(0)).worker for _ in range(7)]
    assert picks == ["a", "c", "d", "a", "c", "d", "a"]


def test_round_robin_keeps_its_cycle_per_instance():
    a, b = get_policy("round_robin"), get_policy("round_robin")
    ws = fleet(3)
    assert [a.choose(req(), ws, random.Random(0)).worker for _ in range(2)] == ["w0", "w1"]
    assert b.choose(req(), ws, random.Random(0)).worker == "w0"


def test_power_of_two_picks_the_less_loaded_of_its_two_samples():
    ws = [worker("busy", running=10), worker("calm", running=2)]
    p2 = get_policy("power_of_two")
    assert {p2.choose(req(), ws, random.Random(s)).worker for s in range(50)} == {"calm"}
    # with three workers the most loaded one always loses its comparison
    ws3 = ws + [worker("mid", running=5)]
    picks = Counter(p2.choose(req(), ws3, random.Random(s)).worker for s in range(300))
    assert picks["busy"] == 0 and picks["calm"] > picks["mid"] > 0


def test_least_loaded_counts_the_routers_own_pending_dispatches():
    ws = [worker("a", running=2), worker("b", running=1, pending=3)]
    d = get_policy("least_loaded").choose(req(), ws, random.Random(0))
    assert d.worker == "a"


# -- kv_aware ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kv_aware", "least_loaded"])
def test_burst_of_distinct_prompts_spreads_over_equal_workers(name):
    # 16 distinct prompts arrive between two reports: only the ledger knows what was sent
    r = Router(name, fleet(4))
    picks = Counter(r.route(chat(f"prompt {i} " * 300, "go"))[0] for i in range(16))
    assert max(picks.values()) <= 8
    assert sorted(picks.values()) == [4, 4, 4, 4]


def test_shared_system_prompt_stays_on_one_worker_while_it_has_room():
    r = Router("kv_aware", fleet(4, total_slots=8))
    system = "You are a helpful assistant with a very long policy. " * 300  # ~4k tokens
    first = [r.route(chat(system, f"question {i}"))[0] for i in range(6)]
    assert len(set(first)) == 1


def test_shared_system_prompt_spreads_once_its_worker_saturates():
    r = Router("kv_aware", fleet(4, total_slots=8))
    system = "You are a helpful assistant with a very long policy. " * 300
    picks = [r.route(chat(system, f"question {i}"))[0] for i in range(40)]
    hot = picks[0]
    assert picks[:8] == [hot] * 8  # fills its slots first: prefill is nearly free there
    # then, once its queue costs more than twice a cold prefill elsewhere (tolerance 1.0), the
    # prefix spreads: no death spiral onto the hot worker
    assert len(set(picks)) >= 3
    assert Counter(picks)[hot] < 20


def test_affine_worker_that_reports_saturation_is_passed_over():
    ws = [worker("hot", running=16, waiting=20), worker("cold1"), worker("cold2")]
    d = KvAware().choose(req(4096, {"hot": 250}), ws, random.Random(0))
    assert d.worker in {"cold1", "cold2"}


def test_affinity_wins_among_near_minimum_workers_even_if_slightly_busier():
    ws = [worker("affine", kv_active_blocks=10), worker("idle1"), worker("idle2")]
    # 64-block prompt, 60 cached on "affine": cheaper anyway
    assert KvAware().choose(req(1024, {"affine": 60}), ws, random.Random(0)).worker == "affine"
    # 2 cached blocks only: affine costs a bit more than the others but is within tolerance
    d = KvAware().choose(req(1024, {"affine": 2}), ws, random.Random(0))
    assert d.worker == "affine"
    assert "overlap=2/64" in d.reason


def test_affinity_never_beats_load_beyond_tolerance():
    ws = [worker("affine", kv_active_blocks=2000, running=12), worker("other")]
    d = KvAware().choose(req(1024, {"affine": 8}), ws, random.Random(0))
    assert d.worker == "other"


def test_multi_turn_conversation_stays_on_its_worker():
    r = Router("kv_aware", fleet(4))
    turns: list[str] = ["You are terse. " * 50]
    home = None
    for t in range(8):
        turns += [f"user turn {t}: " + "tell me more " * 40, f"answer {t} " * 60]
        w, rid = r.route(chat(*turns[:-1]))
        r.ledger.on_first_token(rid)
        # unrelated traffic keeps the other workers about as busy
        for k in range(3):
            r.route(chat(f"other conversation {t}-{k} " * 80))
        home = home or w
        assert w == home, f"turn {t} moved from {home} to {w}"


def test_decision_reason_states_overlap_and_cost():
    d = KvAware().choose(req(640, {"w1": 12}), fleet(3), random.Random(0))
    assert d.worker == "w1" and d.policy == "kv_aware"
    assert d.reason.startswith("overlap=12/40 blocks, cost=")


def test_idle_workers_stale_busy_report_is_not_load_but_its_in_flight_is():
    ledger = Ledger(clock=lambda: 0.0)
    stale = worker("stale", "idle", running=16, waiting=9, kv_active_blocks=4000)
    live = worker("live", running=3, kv_active_blocks=1500)
    pick = KvAware().choose(req(), [ledger.apply(stale), ledger.apply(live)], random.Random(0))
    assert pick.worker == "stale"  # its last (busy) report is not load any more
    for i in range(6):
        ledger.on_routed(f"r{i}", "stale", 512)
        ledger.on_first_token(f"r{i}")
    ledger.on_report("stale", 10.0)  # even a report would not make these invisible: it's idle
    pick = KvAware().choose(req(), [ledger.apply(stale), ledger.apply(live)], random.Random(0))
    assert pick.worker == "live"


def test_kv_over_the_high_watermark_is_penalised():
    ws = [worker("full", kv_active_blocks=3900), worker("roomy", kv_active_blocks=3200, waiting=2)]
    assert KvAware().choose(req(1024), ws, random.Random(0)).worker == "roomy"
    cfg = KvAwareConfig(kv_overflow_weight=0.0, turn_tolerance=0.0)  # (costs 12 % apart: no turns)
    assert KvAware(cfg).choose(req(1024), ws, random.Random(0)).worker == "full"


def test_a_burst_of_cold_prompts_is_not_stacked_into_one_prefill_batch_by_a_hot_set_difference():
    """Three 200-block prompts arrive at once (the Mooncake trace's bursts); two workers differ only in
    their hot sets (3,000 vs 5,000 blocks, mostly prompts sent once). All three on w0 share one prefill
    batch — each first token waits for 600 blocks — while two there and one on w1 wait 400 and 200.
    With live_weight 4 / kv_weight 1 / tolerance 1 the hot-set difference (8,000) outweighed the
    prefill queued ahead and all three went to w0."""
    ledger = Ledger(clock=lambda: 0.0)
    views = [worker(name, total_slots=128, kv_total_blocks=3125, kv_active_blocks=1500, running=8,
                    hot_blocks=hot, reused_blocks=200) for name, hot in (("w0", 3000), ("w1", 5000))]
    policy, rng, got = KvAware(), random.Random(0), []
    for i in range(3):
        r = req(200 * 16)
        d = policy.choose(r, [ledger.apply(v) for v in views], rng)
        ledger.on_routed(f"r{i}", d.worker, r.prompt_blocks)
        got.append(d.worker)
    assert sorted(Counter(got).values()) == [1, 2]


def test_a_cold_prompt_goes_where_it_evicts_no_reused_prefix():
    """Two hot system prompts fill w0's cache; a new one there would push one of them out (and it
    would be prefilled again on its next request): the cold prompt goes to w1 instead."""
    ws = [worker("w0", kv_total_blocks=600, hot_blocks=500, reused_blocks=500),
          worker("w1", kv_total_blocks=600, hot_blocks=250, reused_blocks=250)]
    picks = {KvAware().choose(req(4096), ws, random.Random(s)).worker for s in range(40)}
    assert picks == {"w1"}
    # without the eviction price (and the live-session price, which also prefers the smaller hot
    # set) the two are equal: ties at random
    flat = KvAware(KvAwareConfig(eviction_weight=0.0, live_weight=0.0))
    assert {flat.choose(req(4096), ws, random.Random(s)).worker for s in range(40)} == {"w0", "w1"}
    # the prompt whose prefix w0 holds still goes there: it evicts nothing new
    assert KvAware().choose(req(4096, {"w0": 250}), ws, random.Random(0)).worker == "w0"


def test_hot_prefixes_must_leave_the_running_requests_room():
    """The benchmark's 4-worker fleet (768 blocks of 16 tokens each) with 4k-token system prompts:
    w0's two hot prompts hold 512 blocks, below the pool but above what leaves the watermark's 10 %
    to its running requests, while w1 holds one and two of its requests just finished. A third
    prompt on w0 would keep evicting the other two (its running requests need room too), so the
    cold prompt goes to w1 despite its follow-up price — in live runs w0 took it and thrashed."""
    ws = [worker("w0", kv_total_blocks=768, hot_blocks=512, reused_blocks=512, kv_active_blocks=300),
          worker("w1", kv_total_blocks=768, hot_blocks=256, reused_blocks=256, kv_active_blocks=280,
                 recent_finished=2)]
    assert {KvAware().choose(req(4224), ws, random.Random(s)).worker for s in range(40)} == {"w1"}
    # the room rule alone (live-session price off, the follow-up price of that run on) ...
    alone = KvAwareConfig(live_weight=0.0, followup_weight=0.3)
    assert {KvAware(alone).choose(req(4224), ws, random.Random(s)).worker for s in range(40)} == {"w1"}
    # ... and with the whole pool as room the follow-up price wins and w0 takes its third prefix
    no_watermark = KvAware(KvAwareConfig(**{**alone.model_dump(), "kv_high_watermark": 1.0}))
    assert {no_watermark.choose(req(4224), ws, random.Random(s)).worker for s in range(40)} == {"w0"}


def test_when_nothing_is_reused_cold_requests_take_turns_among_the_near_cheapest():
    """No worker holds reused prefixes (no live sessions to protect): of the workers within
    turn_tolerance of the cheapest, the one routed to longest ago takes the request — not the one
    a few blocks cheaper — and a worker far costlier is never its turn."""
    ws = [worker("w0", kv_active_blocks=40, last_routed_at=9.0),
          worker("w1", kv_active_blocks=80, last_routed_at=5.0),
          worker("w2", last_routed_at=7.0), worker("far", waiting=3, last_routed_at=1.0)]
    d = KvAware().choose(req(4096), ws, random.Random(0))
    assert d.worker == "w1" and "its turn of 3" in d.reason
    # off: the cheapest (w2); and likewise once any worker holds reused prefixes
    assert KvAware(KvAwareConfig(turn_tolerance=0.0)).choose(req(4096), ws, random.Random(0)).worker == "w2"
    ws[3] = replace(ws[3], hot_blocks=256, reused_blocks=256)
    assert KvAware().choose(req(4096), ws, random.Random(0)).worker == "w2"


def test_identical_cold_requests_reach_each_worker_in_turn():
    """Through the ledger (which dates every dispatch): 12 distinct prompts on 4 equal workers go
    round the fleet three times, each worker once per round, while every one's prefill is still
    running (the costs differ by the pending prefills, all within the tolerance)."""
    r = Router("kv_aware", fleet(4))
    picks = [r.route(chat(f"distinct prompt {i} " + "x " * 400))[0] for i in range(12)]
    rounds = [picks[k:k + 4] for k in range(0, 12, 4)]
    assert all(sorted(rd) == ["w0", "w1", "w2", "w3"] for rd in rounds), picks
    assert rounds[1] == rounds[0] and rounds[2] == rounds[0]  # the same order each round


def test_a_cold_prompt_avoids_the_worker_whose_conversations_are_between_turns():
    """w0 just finished 6 requests (their next turns are coming back there); a cold 4k prompt
    would make them wait behind its prefill, so it goes to w1 — while w0's own follow-up stays."""
    ws = [worker("w0", recent_finished=6), worker("w1")]
    on = KvAware(KvAwareConfig(followup_weight=0.3))  # off by default (the live-session price below)
    assert {on.choose(req(4096), ws, random.Random(s)).worker for s in range(40)} == {"w1"}
    off = KvAware(KvAwareConfig(followup_weight=0.0))
    assert {off.choose(req(4096), ws, random.Random(s)).worker for s in range(40)} == {"w0", "w1"}
    assert on.choose(req(4096, {"w0": 250}), ws, random.Random(0)).worker == "w0"


def test_a_cold_prompt_goes_to_the_worker_with_fewer_live_sessions():
    """w0 holds three live conversations (hot blocks 600), w1 one (200), both idle right now
    (their conversations are between turns): a new conversation's first turn would make the next
    turns of the sessions on its worker wait behind its 200-block prefill, so it goes to w1; a
    follow-up of one of w0's conversations still goes to w0 (its cold share is small)."""
    ws = [worker("w0", hot_blocks=600), worker("w1", hot_blocks=200)]
    assert {KvAware().choose(req(3200), ws, random.Random(s)).worker for s in range(40)} == {"w1"}
    off = KvAware(KvAwareConfig(live_weight=0.0))
    assert {off.choose(req(3200), ws, random.Random(s)).worker for s in range(40)} == {"w0", "w1"}
    assert KvAware().choose(req(3328, {"w0": 200}), ws, random.Random(0)).worker == "w0"


def test_costs_are_normalised_by_capacity_on_heterogeneous_fleets():
    small = worker("small", kv_total_blocks=1000, kv_active_blocks=100)
    big = worker("big", kv_total_blocks=3000, kv_active_blocks=250)  # 2.5× the load, 3× the room
    assert KvAware().choose(req(160), [small, big], random.Random(0)).worker == "big"
    flat = KvAware(KvAwareConfig(normalize_by_capacity=False))
    assert flat.choose(req(160), [small, big], random.Random(0)).worker == "small"


def test_other_replicas_pending_dispatches_steer_away_from_their_worker():
    ws = fleet(2)
    mine = Ledger(replica_id="a", clock=lambda: 0.0)
    theirs = Ledger(replica_id="b", clock=lambda: 0.0)
    for i in range(3):
        theirs.on_routed(f"b{i}", "w0", 64)
    mine.merge_remote("b", theirs.export(), at=0.0)
    picks = {KvAware().choose(req(), [mine.apply(w) for w in ws], random.Random(s)).worker
             for s in range(50)}
    assert picks == {"w1"}


def test_kv_aware_config_is_frozen_and_validated():
    from pydantic import ValidationError

    cfg = KvAwareConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.tolerance = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="kv_high_watermark"):
        KvAwareConfig(kv_high_watermark=1.5)
    with pytest.raises(ValueError, match="prefill_weight"):
        KvAwareConfig(prefill_weight=-1)


def test_kv_aware_config_keeps_types_rejects_unknown_keys_and_describes_every_knob():
    from pydantic import ValidationError

    cfg = KvAwareConfig.model_validate({"min_overlap_blocks": 2, "normalize_by_capacity": False, "tolerance": 1})
    assert type(cfg.min_overlap_blocks) is int and cfg.normalize_by_capacity is False
    assert type(cfg.tolerance) is float
    with pytest.raises(ValidationError, match="min_overlap_blocks"):
        KvAwareConfig(min_overlap_blocks=1.5)
    with pytest.raises(ValidationError, match="toleranse"):
        KvAwareConfig.model_validate({"toleranse": 0.5})
    for name, field in KvAwareConfig.model_fields.items():
        assert field.description and len(field.description) > 20, name


def test_kv_aware_prices_the_delay_a_prompt_adds_to_the_batch_it_joins():
    """w0 holds two short prompts before their first token, w1 one longer one with more blocks left:
    by its own wait a 100-block prompt is cheaper on w0 (20 blocks ahead vs 40), but there it delays
    two requests by its whole prefill, on w1 one — the sum of first-token times is lower on w1."""
    from serve_app.policies.kv_aware import KvAware, KvAwareConfig

    # (reused prefixes elsewhere on both: no turn-taking, the cheapest wins)
    ws = [worker("w0", pending_prefill_blocks=20, prefilling=2, in_flight=2, reused_blocks=1),
          worker("w1", pending_prefill_blocks=40, prefilling=1, in_flight=1, reused_blocks=1)]
    r = req(tokens=1600)
    assert KvAware(KvAwareConfig(cobatch_weight=0.0)).choose(r, ws, random.Random(0)).worker == "w0"
    assert KvAware().choose(r, ws, random.Random(0)).worker == "w1"
    costs = KvAware().costs(r, ws)
    assert costs["w0"] - costs["w1"] == pytest.approx(4.0 * (20 - 40) + 4.0 * 100 * (2 - 1))


def test_stall_weight_prices_the_pause_of_the_requests_decoding_there():
    # w0 streams three replies (this router's, past their first token), w1 one reported by the engine
    ws = [worker("w0", in_flight=3, pending_kv_blocks=10, reused_blocks=1),
          worker("w1", running=1, kv_active_blocks=30, reused_blocks=1)]
    r = req(tokens=1600)  # 100 new blocks
    assert KvAware().choose(r, ws, random.Random(0)).worker == "w0"  # off by default: KV held decides
    priced = KvAware(KvAwareConfig(stall_weight=1.0))
    assert priced.choose(r, ws, random.Random(0)).worker == "w1"
    default, costs = KvAware().costs(r, ws), priced.costs(r, ws)
    assert costs["w0"] - default["w0"] == pytest.approx(4.0 * 100 * 3)  # prefill_weight · new · decoding
    assert costs["w1"] - default["w1"] == pytest.approx(4.0 * 100 * 1)  # the report's running count
    # requests still before their first token are co-batched, not paused: not counted twice
    ws = [worker("w0", in_flight=3, prefilling=3, reused_blocks=1)]
    assert priced.costs(r, ws)["w0"] == pytest.approx(KvAware().costs(r, ws)["w0"])


def test_kv_aware_docstring_states_the_formula():
    import serve_app.policies.kv_aware as mod

    for term in ("prefill_weight", "queued_request_blocks", "kv_high_watermark", "tolerance",
                 "eviction_weight", "hot_blocks", "followup_weight", "recent_finished", "turn_tolerance",
                 "reused_blocks", "last_routed_at", "cobatch_weight", "prefilling", "kv_weight", "stall_weight",
                 "decoding"):
        assert term in mod.__doc__


# -- FleetView: the router's incrementally updated fleet ---------------------------------------


def random_fleet(rng: random.Random, n: int) -> list[WorkerView]:
    return [
        worker(f"w{i}", rng.choice(["live", "live", "idle", "down"]), running=rng.randrange(20),
               total_slots=16, waiting=rng.randrange(3), kv_active_blocks=rng.randrange(4096),
               kv_total_blocks=rng.choice([4096, 8192, 0]), pending=rng.randrange(3),
               pending_prefill_blocks=rng.randrange(200), pending_kv_blocks=rng.randrange(200),
               remote_pending=rng.randrange(2), hot_blocks=rng.randrange(8192),
               recent_finished=rng.randrange(4), last_routed_at=rng.choice([0.0, 1.0, rng.uniform(0, 9)]))
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [5, 200])  # fresh columns (a plain list) vs columns updated one worker at a time
def test_fleet_view_decides_exactly_like_a_plain_list(n):
    from serve_app.policies.fleet import FleetView

    rng = random.Random(n)
    policy = KvAware()
    for trial in range(30):
        views = random_fleet(rng, n)
        if all(v.state == "down" for v in views):
            continue
        if trial % 3 == 0:  # some hold reused prefixes (no turn-taking) or none do
            views = [replace(v, reused_blocks=v.hot_blocks // 2) for v in views]
        fv = FleetView(views)
        # a few workers overlap (scattered by position) or most do (looked up per worker)
        holders = 3 if trial % 2 else n
        ov = {f"w{rng.randrange(n)}": rng.randrange(1, 80) for _ in range(holders)}
        r = req(rng.randrange(16, 2048), ov)
        a = policy.choose(r, views, random.Random(trial))
        b = policy.choose(r, fv, random.Random(trial))
        assert (a.worker, a.reason) == (b.worker, b.reason)
        # an update of one worker is seen by the cached columns
        target = fv[rng.randrange(n)]
        idle_now = replace(target, state="live", running=0, waiting=0, kv_active_blocks=0, pending=0,
                           pending_prefill_blocks=0, pending_kv_blocks=0, remote_pending=0)
        fv.update(idle_now)
        views = [idle_now if v.name == target.name else v for v in views]
        a = policy.choose(r, views, random.Random(trial))
        b = policy.choose(r, fv, random.Random(trial))
        assert (a.worker, a.reason) == (b.worker, b.reason)
        # fleet-wide figures follow too: a capacity change (scale), a worker going down, a nearly
        # full one (the overflow/eviction pre-checks)
        picked = fv.get(b.worker)
        for changed in (replace(target, kv_total_blocks=rng.choice([1024, 16384, 0])),
                        replace(fv[rng.randrange(n)], state="down"),
                        replace(picked, kv_total_blocks=64, kv_active_blocks=63, hot_blocks=64)):
            fv.update(changed)
            views = [changed if v.name == changed.name else v for v in views]
            if all(v.state == "down" for v in views):
                break
            a = policy.choose(r, views, random.Random(trial))
            b = policy.choose(r, fv, random.Random(trial))
            assert (a.worker, a.reason) == (b.worker, b.reason)
            assert policy.costs(r, views) == pytest.approx(policy.costs(r, fv))


def test_fleet_view_rejects_duplicate_names_and_supports_removal():
    from serve_app.policies.fleet import FleetView

    with pytest.raises(ValueError, match="twice"):
        FleetView([worker("a"), worker("a")])
    fv = FleetView([worker("a", running=9), worker("b")])
    assert KvAware().choose(req(), fv, random.Random(0)).worker == "b"
    fv.remove("b")
    assert KvAware().choose(req(), fv, random.Random(0)).worker == "a"
    assert len(fv) == 1 and fv.get("b") is None


# -- the cost is the module docstring's formula -------------------------------------------------


def docstring_cost(w: WorkerView, overlap: int, P: int, B: int, cfg: KvAwareConfig) -> float:
    """kv_aware's raw cost of one worker, term by term as the module docstring states it."""
    o = min(overlap, P)
    if o < max(1, cfg.min_overlap_blocks):
        o = 0
    new = P - o
    prefill = w.pending_prefill_blocks + cfg.remote_request_blocks * w.remote_pending \
        + new * (1 + cfg.cobatch_weight * (w.prefilling + w.waiting)
                 + cfg.stall_weight * max(w.in_flight - w.prefilling, w.running))
    held = w.kv_active_blocks * w.page_size / B + w.pending_kv_blocks
    kv = cfg.kv_weight * (held + new)
    queued = w.waiting + (max(0, w.running + w.pending + w.remote_pending + 1 - w.total_slots) if w.total_slots else 0)
    over = evict = 0.0
    if w.kv_total_blocks:
        total = w.kv_total_blocks * w.page_size / B
        over = max(0.0, held + new - cfg.kv_high_watermark * total)
        room = min(total - held, cfg.kv_high_watermark * total - w.hot_blocks)
        evict = min(new, max(0.0, new - room))
    live = w.hot_blocks * new / P if P else 0.0
    return (cfg.prefill_weight * prefill + kv + cfg.queued_request_blocks * queued + cfg.kv_overflow_weight * over
            + cfg.eviction_weight * evict + cfg.live_weight * live + cfg.followup_weight * w.recent_finished * new)


@pytest.mark.parametrize("n", [5, 200])
@pytest.mark.parametrize("cfg", [KvAwareConfig(), KvAwareConfig(kv_weight=0.5, followup_weight=0.3, min_overlap_blocks=4,
                                                               stall_weight=0.5),
                                 KvAwareConfig(normalize_by_capacity=False, live_weight=0.0)])
def test_kv_aware_costs_are_the_docstring_formula(n, cfg):
    rng = random.Random(n)
    policy = KvAware(cfg)
    for _ in range(20):
        views = [replace(v, prefilling=rng.randrange(3), page_size=rng.choice([1, 16, 32]))
                 for v in random_fleet(rng, n)]
        up = [v for v in views if v.state != "down"]
        if not up:
            continue
        ov = {f"w{rng.randrange(n)}": rng.randrange(1, 80) for _ in range(max(1, n // 3))}
        r = req(rng.randrange(16, 4096), ov)
        raw = {v.name: docstring_cost(v, ov.get(v.name, 0), r.prompt_blocks, 16, cfg) for v in up}
        caps = [v.kv_total_blocks * v.page_size for v in up if v.kv_total_blocks]
        if cfg.normalize_by_capacity and caps and min(caps) != max(caps):
            mean = sum(caps) / len(caps)
            raw = {v.name: raw[v.name] * (mean / (v.kv_total_blocks * v.page_size) if v.kv_total_blocks else 1.0)
                   for v in up}
        assert policy.costs(r, views) == pytest.approx(raw, rel=1e-9)


def test_kv_aware_decides_the_same_on_index_tiers_as_on_a_plain_overlap_dict():
    """The prefix index answers tiers of its holder sets; kv_aware scatters them by worker id. The
    decision must be the one a plain {worker: blocks} mapping of the same overlap gives."""
    from serve_app.policies.fleet import FleetView
    from serve_app.policies.overlap import Overlap

    rng = random.Random(7)
    t = [0.0]
    index = PrefixIndex(clock=lambda: t[0], ttl_s=50.0)
    shared = list(range(1, 41))
    prompt = shared + list(range(1000, 1200))
    views = random_fleet(rng, 300) + [worker("not-in-the-fleet-view")]
    for v in views:
        t[0] += 0.1
        index.record(v.name, shared)
    for k in range(6):
        t[0] += 1
        index.record(f"w{k}", prompt[: 40 + 30 * k])
    t[0] += 29.0  # the first half of the shared prefix's holders are stale now: fixed per worker
    fv = FleetView(views[:-1])
    for p in (prompt, shared[:20], prompt[:70]):
        ov = index.overlap(p)
        assert isinstance(ov, Overlap) and ov.fixed and len(ov.tiers) >= (2 if len(p) > 40 else 1)
        plain = dict(ov.as_dict())
        assert plain.get("w5") == min(len(p), 190) and "w299" in plain and "w10" not in plain
        assert plain.get("w0") == min(len(p), 40) and len(plain) < 200
        r = req(len(p) * 16)
        for s in range(20):
            a = KvAware().choose(r.with_overlap(ov), fv, random.Random(s))
            b = KvAware().choose(r.with_overlap(plain), views[:-1], random.Random(s))
            assert (a.worker, a.reason) == (b.worker, b.reason)
