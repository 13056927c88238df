"""The simulated scheduler: KvMetrics cadence, token accounting, prefix cache, queueing, eviction."""

from __future__ import annotations

import pytest

from sim.config import EngineConfig
from sim.engine import BatchKind, Engine, KvReport, RequestRejected, run_until_idle
from sim.kv_events import BlockRemoved, BlockStored, KvEvent, block_hashes, page_digests


class Recorder:
    def __init__(self) -> None:
        self.reports: list[KvReport] = []
        self.event_batches: list[list[KvEvent]] = []

    def on_kv_metrics(self, report: KvReport) -> None:
        self.reports.append(report)

    def on_kv_events(self, events: list[KvEvent]) -> None:
        self.event_batches.append(list(events))

    @property
    def events(self) -> list[KvEvent]:
        return [e for batch in self.event_batches for e in batch]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make(**overrides) -> tuple[Engine, Recorder, FakeClock]:
    cfg = dict(page_size=4, max_total_num_tokens=400, decode_log_interval=3, max_running_requests=8)
    cfg.update(overrides)
    rec = Recorder()
    return Engine(EngineConfig(**cfg), rec), rec, FakeClock()


def step(engine: Engine, clock: FakeClock):
    batch = engine.schedule(clock())
    assert batch is not None
    clock.advance(batch.duration)
    return batch, engine.complete(batch, clock())


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------ cadence


def test_one_report_after_each_prefill_batch_and_every_interval_decode_steps():
    engine, rec, clock = make(decode_log_interval=3)
    engine.submit("a", prompt(10), max_new_tokens=8, now=clock())
    batch, _ = step(engine, clock)
    assert batch.kind == BatchKind.PREFILL
    assert len(rec.reports) == 1
    for n_decode in range(1, 7):
        batch, _ = step(engine, clock)
        assert batch.kind == BatchKind.DECODE
        assert len(rec.reports) == 1 + n_decode // 3
    # 8 tokens = 1 from prefill + 7 decode steps; the 7th step finishes the request
    step(engine, clock)
    assert engine.is_idle
    assert len(rec.reports) == 3  # prefill, decode step 3, decode step 6


def test_nothing_is_reported_while_idle():
    engine, rec, clock = make()
    assert engine.schedule(clock()) is None
    clock.advance(100.0)
    assert engine.schedule(clock()) is None
    assert rec.reports == []
    engine.submit("a", prompt(5), 2, clock())
    run_until_idle(engine, clock, clock.advance)
    n = len(rec.reports)
    for _ in range(5):
        clock.advance(10.0)
        assert engine.schedule(clock()) is None
    assert len(rec.reports) == n


def test_decode_log_interval_counts_decode_steps_over_the_engine_lifetime():
    engine, rec, clock = make(decode_log_interval=4)
    engine.submit("a", prompt(5), 3, clock())  # 2 decode steps
    run_until_idle(engine, clock, clock.advance)
    assert [r.gpu_prefix_cache_hit_rate for r in rec.reports] == [0.0]  # only the prefill report
    engine.submit("b", prompt(5, start=5000), 3, clock())  # decode steps 3 and 4 → report at 4
    run_until_idle(engine, clock, clock.advance)
    assert len(rec.reports) == 3
    assert engine.forward_ct_decode == 4


def test_prefill_report_carries_batch_hit_rate_and_decode_reports_zero():
    engine, rec, clock = make(decode_log_interval=1)
    engine.submit("a", prompt(17), 2, clock())
    run_until_idle(engine, clock, clock.advance)
    engine.submit("b", prompt(17), 2, clock())  # same prompt: 16 of 17 tokens matchable
    step(engine, clock)
    assert rec.reports[-1].gpu_prefix_cache_hit_rate == pytest.approx(16 / 17)
    step(engine, clock)
    assert rec.reports[-1].gpu_prefix_cache_hit_rate == 0.0


def test_0_5_23_decode_reports_keep_the_prefill_hit_rate():
    """SGLang 0.5.23 (seen on the real server, tests/real_engine/test_sim_parity.py): a decode report
    carries the last prefill batch's hit rate ("cache_hit_rate is prefill-owned")."""
    engine, rec, clock = make(decode_log_interval=1, decode_keeps_hit_rate=True)
    engine.submit("a", prompt(17), 2, clock())
    run_until_idle(engine, clock, clock.advance)
    engine.submit("b", prompt(17), 3, clock())
    step(engine, clock)
    assert rec.reports[-1].gpu_prefix_cache_hit_rate == pytest.approx(16 / 17)
    step(engine, clock)
    assert rec.reports[-1].gpu_prefix_cache_hit_rate == pytest.approx(16 / 17)


def test_0_5_23_rounds_usage_to_two_decimals_in_every_report():
    engine, rec, clock = make(page_size=1, max_total_num_tokens=300, decode_log_interval=1, round_usage=True)
    engine.submit("a", prompt(10), 3, clock())
    step(engine, clock)  # prefill: 10 of 300 tokens
    assert rec.reports[-1].gpu_cache_usage_perc == 0.03 and rec.reports[-1].kv_active_blocks == int(0.03 * 300)
    step(engine, clock)  # decode: 11 of 300 = 0.0367
    assert rec.reports[-1].gpu_cache_usage_perc == 0.04 and rec.reports[-1].kv_active_blocks == int(0.04 * 300)


def test_an_input_as_long_as_the_context_is_refused_with_sglangs_message():
    engine, _, clock = make(context_length=64)
    with pytest.raises(RequestRejected, match=r"^The input \(64 tokens\) is longer than the model's context length \(64 tokens\)\.$"):
        engine.submit("a", prompt(64), 1, clock())
    with pytest.raises(RequestRejected, match="Requested token count exceeds"):
        engine.submit("b", prompt(60), 8, clock())


# ------------------------------------------------------------------ token accounting


def test_kv_active_blocks_counts_tokens_in_whole_pages():
    engine, rec, clock = make(page_size=4, max_total_num_tokens=400)
    engine.submit("a", prompt(10), 5, clock())  # 10 tokens → 3 pages = 12 tokens
    step(engine, clock)
    r = rec.reports[-1]
    assert r.kv_total_blocks == 400
    assert r.kv_active_blocks == 12
    assert r.gpu_cache_usage_perc == pytest.approx(12 / 400)
    assert r.kv_active_blocks == int(r.gpu_cache_usage_perc * r.kv_total_blocks)
    assert r.request_total_slots == 8


def test_pool_is_floored_to_whole_pages():
    engine, rec, clock = make(page_size=16, max_total_num_tokens=1000)
    engine.submit("a", prompt(20), 1, clock())
    step(engine, clock)
    assert engine.max_total_num_tokens == 992
    assert rec.reports[-1].kv_total_blocks == 992


def test_usage_excludes_evictable_cache_pages():
    engine, rec, clock = make(decode_log_interval=1)
    engine.submit("a", prompt(16), 1, clock())
    run_until_idle(engine, clock, clock.advance)
    stats = engine.stats()
    assert stats.used_tokens == 0
    assert stats.evictable_tokens == 16  # the prompt's 4 full pages stay cached, unlocked
    assert stats.token_usage == 0.0


def test_decode_allocates_a_new_page_when_a_page_fills():
    engine, rec, clock = make(page_size=4, decode_log_interval=1)
    engine.submit("a", prompt(4), 6, clock())
    step(engine, clock)  # prefill: 4 tokens, 1 page
    assert engine.stats().used_tokens == 4
    step(engine, clock)  # KV of output token 1 → second page
    assert engine.stats().used_tokens == 8
    assert rec.reports[-1].kv_active_blocks == 8


def test_active_slots_and_waiting_follow_the_scheduler():
    engine, rec, clock = make(max_running_requests=2, decode_log_interval=1)
    for rid in "abc":
        engine.submit(rid, prompt(5, start=ord(rid) * 100), 4, clock())
    step(engine, clock)  # prefill a, b (c waits: max_running_requests)
    prefill = rec.reports[-1]
    assert prefill.request_active_slots == 0  # SGLang counts the running batch before the merge
    assert prefill.num_requests_waiting == 1
    step(engine, clock)
    decode = rec.reports[-1]
    assert decode.request_active_slots == 2
    assert decode.num_requests_waiting == 1


def test_wire_04_9_rounds_prefill_usage_to_two_decimals():
    engine, rec, clock = make(page_size=1, max_total_num_tokens=300, round_prefill_usage=True)
    engine.submit("a", prompt(10), 2, clock())
    step(engine, clock)
    assert rec.reports[-1].gpu_cache_usage_perc == 0.03
    assert rec.reports[-1].kv_active_blocks == int(0.03 * 300)


def test_output_length_is_exactly_max_new_tokens():
    engine, _, clock = make()
    engine.submit("a", prompt(7), 9, clock())
    engine.submit("z", prompt(7, start=9), 0, clock())
    outputs = run_until_idle(engine, clock, clock.advance)
    a = [o for o in outputs if o.rid == "a"]
    assert [o.index for o in a] == list(range(9))
    assert a[-1].finished and a[-1].finish_reason == "length"
    z = [o for o in outputs if o.rid == "z"]
    assert len(z) == 1 and z[0].token_id is None and z[0].finished


def test_generated_tokens_are_deterministic_per_prompt():
    e1, _, c1 = make()
    e2, _, c2 = make()
    e1.submit("x", prompt(12), 6, c1())
    e2.submit("y", prompt(12), 6, c2())
    t1 = [o.token_id for o in run_until_idle(e1, c1, c1.advance)]
    t2 = [o.token_id for o in run_until_idle(e2, c2, c2.advance)]
    assert t1 == t2


# ------------------------------------------------------------------ timing


def test_batch_durations_follow_the_cost_model():
    engine, _, clock = make(
        prefill_base_s=0.01, prefill_per_token_s=0.001, decode_base_s=0.02, decode_per_req_s=0.005,
        decode_per_kv_token_s=0.0,
    )
    engine.submit("a", prompt(10), 3, clock())
    engine.submit("b", prompt(6, start=50), 3, clock())
    prefill, _ = step(engine, clock)
    assert prefill.duration == pytest.approx(0.01 + 0.001 * 16)
    decode, _ = step(engine, clock)
    assert decode.duration == pytest.approx(0.02 + 0.005 * 2)


def test_cached_prefix_shortens_the_next_prefill_and_its_ttft():
    engine, _, clock = make(page_size=4, prefill_base_s=0.0, prefill_per_token_s=0.001)
    long = prompt(41)
    engine.submit("a", long, 1, clock())
    first, _ = step(engine, clock)
    engine.submit("b", long, 1, clock())
    t0 = clock()
    second, _ = step(engine, clock)
    assert first.duration == pytest.approx(0.041)
    assert second.duration == pytest.approx(0.001)  # 40 of 41 tokens cached
    assert second.hit_tokens == 40
    assert clock() - t0 == pytest.approx(0.001)


# ------------------------------------------------------------------ prefix cache


def test_shared_prefix_hits_in_whole_pages():
    engine, _, clock = make(page_size=4)
    system = prompt(12)
    engine.submit("a", system + [1, 2, 3], 2, clock())
    run_until_idle(engine, clock, clock.advance)
    req = engine.submit("b", system + [7, 8, 9, 10, 11], 2, clock())
    step(engine, clock)
    assert req.cached_tokens == 12
    stats = engine.stats()
    assert stats.cached_tokens_total == 12
    assert stats.cumulative_cache_hit_rate == pytest.approx(12 / (15 + 17))


def test_a_multi_turn_conversation_hits_through_the_previous_reply():
    from sim.tokenizer import apply_chat_template, decode

    engine, _, clock = make(page_size=4)
    turn1 = [{"role": "user", "content": "tell me a story about a very long river"}]
    ids1 = apply_chat_template(turn1)
    engine.submit("t1", ids1, 12, clock())
    reply = decode(o.token_id for o in run_until_idle(engine, clock, clock.advance))
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    ids2 = apply_chat_template(turn2)
    req = engine.submit("t2", ids2, 4, clock())
    step(engine, clock)
    kv_len_turn1 = len(ids1) + 12 - 1  # the last reply token's KV is never computed
    assert req.cached_tokens == (kv_len_turn1 // 4) * 4
    assert req.cached_tokens > len(ids1)


def test_identical_prompts_in_one_batch_share_pages_after_insertion():
    engine, _, clock = make(page_size=4)
    engine.submit("a", prompt(16), 1, clock())
    engine.submit("b", prompt(16), 1, clock())
    run_until_idle(engine, clock, clock.advance)
    stats = engine.stats()
    assert stats.cached_pages == 4  # deduplicated on insert
    assert stats.evictable_tokens == 16
    assert engine.pool.free_pages == engine.pool.num_pages - 4


# ------------------------------------------------------------------ queueing


def test_max_running_requests_caps_the_batch_and_the_rest_wait_fifo():
    engine, _, clock = make(max_running_requests=2)
    for i in range(4):
        engine.submit(f"r{i}", prompt(5, start=100 * i), 3, clock())
    batch, _ = step(engine, clock)
    assert [r.rid for r in batch.reqs] == ["r0", "r1"]
    assert [r.rid for r in engine.waiting] == ["r2", "r3"]
    assert len(engine.running) == 2
    outputs = run_until_idle(engine, clock, clock.advance)
    finished = [o.rid for o in outputs if o.finished]
    assert finished == ["r0", "r1", "r2", "r3"]


def test_kv_exhaustion_queues_requests_until_memory_frees():
    # 40 tokens = 10 pages; each request needs ceil((16 + 8 - 1) / 4) = 6 pages for its lifetime
    engine, rec, clock = make(page_size=4, max_total_num_tokens=40, decode_log_interval=1)
    engine.submit("a", prompt(16), 8, clock())
    engine.submit("b", prompt(16, start=500), 8, clock())
    batch, _ = step(engine, clock)
    assert [r.rid for r in batch.reqs] == ["a"]
    assert rec.reports[-1].num_requests_waiting == 1
    while engine.requests.get("a") is not None:
        step(engine, clock)
    batch, _ = step(engine, clock)
    assert batch.kind == BatchKind.PREFILL and [r.rid for r in batch.reqs] == ["b"]


def test_prefill_token_budget_splits_admission_across_batches():
    engine, _, clock = make(max_prefill_tokens=20)
    for i in range(3):
        engine.submit(f"r{i}", prompt(12, start=100 * i), 2, clock())
    batch, _ = step(engine, clock)
    assert [r.rid for r in batch.reqs] == ["r0"]  # r0 + r1 = 24 > 20
    batch, _ = step(engine, clock)
    assert batch.kind == BatchKind.PREFILL and [r.rid for r in batch.reqs] == ["r1"]


def test_requests_that_can_never_fit_are_rejected():
    engine, _, clock = make(page_size=4, max_total_num_tokens=40, context_length=100)
    with pytest.raises(RequestRejected, match="context length"):
        engine.submit("long", prompt(90), 20, clock())
    with pytest.raises(RequestRejected, match="max_total_num_tokens"):
        engine.submit("huge", prompt(45), 1, clock())
    with pytest.raises(RequestRejected, match="empty"):
        engine.submit("empty", [], 1, clock())
    assert engine.is_idle


# ------------------------------------------------------------------ eviction


def test_lru_eviction_frees_the_least_recently_used_unlocked_pages():
    engine, rec, clock = make(page_size=4, max_total_num_tokens=32, record_kv_events=True)
    old, recent = prompt(8, start=100), prompt(8, start=200)
    engine.submit("old", old, 1, clock())
    run_until_idle(engine, clock, clock.advance)
    clock.advance(1.0)
    engine.submit("recent", recent, 1, clock())
    run_until_idle(engine, clock, clock.advance)
    clock.advance(1.0)
    engine.submit("touch-old", old + [1], 1, clock())  # re-uses `old`: now `recent` is LRU
    run_until_idle(engine, clock, clock.advance)
    assert engine.pool.free_pages == 4 and engine.stats().evictable_tokens == 16
    engine.submit("big", prompt(21, start=900), 1, clock())  # needs 6 pages: evict 2
    run_until_idle(engine, clock, clock.advance)
    removed = [h for e in rec.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(block_hashes(recent, 4))
    assert engine.pool.match(page_digests(old, 4)) == 2  # the recently used prefix survives
    assert engine.pool.match(page_digests(recent, 4)) == 0
    assert engine.stats().evicted_pages_total == 2


def test_locked_pages_are_never_evicted():
    engine, _, clock = make(page_size=4, max_total_num_tokens=24)  # 6 pages
    cold = prompt(8, start=700)
    engine.submit("cold", cold, 1, clock())
    run_until_idle(engine, clock, clock.advance)  # 2 evictable pages, 4 free
    engine.submit("a", prompt(12), 2, clock())  # 3 pages now + 1 reserved for decode
    step(engine, clock)
    a = engine.requests["a"]
    engine.submit("b", prompt(8, start=300), 1, clock())  # 2 pages: only 1 free → evict 1
    step(engine, clock)
    assert engine.stats().evicted_pages_total == 1
    assert engine.pool.match(a.chain) == 3
    step(engine, clock)  # a's decode takes its reserved page → evicts the other cold page
    assert engine.stats().evicted_pages_total == 2
    assert engine.pool.match(page_digests(cold, 4)) == 0
    assert engine.pool.match(a.chain) == 3


def test_abort_releases_memory_and_reservation():
    engine, _, clock = make(page_size=4, max_total_num_tokens=40)
    engine.submit("a", prompt(16), 20, clock())
    step(engine, clock)
    assert engine.reserved_pages > 0
    assert engine.abort("a", clock())
    assert engine.reserved_pages == 0
    assert engine.stats().used_tokens == 0
    assert engine.is_idle


def test_abort_during_a_batch_in_flight_is_applied_at_completion():
    engine, _, clock = make()
    engine.submit("a", prompt(8), 5, clock())
    batch = engine.schedule(clock())
    engine.abort("a", clock())
    clock.advance(batch.duration)
    outputs = engine.complete(batch, clock())
    assert [(o.rid, o.finish_reason) for o in outputs] == [("a", "abort")]
    assert engine.is_idle and engine.stats().used_tokens == 0


# ------------------------------------------------------------------ KV events from the engine


def test_store_events_chain_pages_and_are_published_with_the_prefill_report():
    engine, rec, clock = make(page_size=4, record_kv_events=True)
    ids = prompt(9)
    engine.submit("a", ids, 1, clock())
    step(engine, clock)
    assert len(rec.event_batches) == 1
    stored = [e for e in rec.events if isinstance(e, BlockStored)]
    hashes = block_hashes(ids, 4)
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in stored] == [None, hashes[0]]
    assert stored[0].token_ids == ids[:4] and stored[0].block_size == 4


def test_flush_cache_clears_everything_only_when_idle():
    from sim.kv_events import AllBlocksCleared

    engine, rec, clock = make(record_kv_events=True)
    engine.submit("a", prompt(8), 3, clock())
    step(engine, clock)
    assert not engine.flush_cache()
    run_until_idle(engine, clock, clock.advance)
    assert engine.flush_cache()
    assert isinstance(rec.events[-1], AllBlocksCleared)
    assert engine.stats().cached_pages == 0
    assert engine.pool.free_pages == engine.pool.num_pages


def test_stats_measure_ttft_and_queueing_in_simulated_seconds():
    engine, _, clock = make(max_running_requests=1, prefill_base_s=0.1, prefill_per_token_s=0.0,
                            decode_base_s=0.5, decode_per_req_s=0.0, decode_per_kv_token_s=0.0)
    engine.submit("a", prompt(4), 2, clock())
    engine.submit("b", prompt(4, start=50), 1, clock())
    run_until_idle(engine, clock, clock.advance)
    stats = engine.stats()
    # a: prefill 0.1 → ttft 0.1, then one decode step (0.5); b waits 0.6, then prefill 0.1
    assert stats.mean_ttft_s == pytest.approx((0.1 + 0.7) / 2)
    assert stats.mean_queue_time_s == pytest.approx((0.0 + 0.6) / 2)
    assert stats.num_waiting_reqs == 0 and stats.requests_finished_total == 2


def test_pd_decode_preallocation_holds_the_prompts_pages_until_admission_or_release():
    """SGLang's decode prealloc queue: a PD decode request's prompt KV is taken when it arrives, before
    the KV is transferred, so the pool (and KvMetrics) show it as used while it waits."""
    eng, rec, clock = make()  # 100 pages of 4 tokens
    assert eng.prealloc("a", 10, 3)  # 3 pages
    assert eng.stats().used_tokens == 12 and eng.stats().num_running_reqs == 0
    with pytest.raises(RequestRejected, match="already in use"):
        eng.prealloc("a", 10, 3)
    assert not eng.prealloc("huge", 1000, 1)  # more than the pool holds now: not held (taken at admission)
    eng.submit("a", list(range(1, 11)), 3, clock(), prefilled=True)
    run_until_idle(eng, clock, clock.advance)
    assert eng.stats().requests_finished_total == 1 and eng.stats().used_tokens == 0  # admitted, finished, freed
    assert rec.reports[0].kv_active_blocks > 0
    eng.prealloc("b", 8, 2)
    eng.release_prealloc("b")  # its KV never came
    assert eng.stats().used_tokens == 0
    eng.prealloc("c", 8, 2)
    eng.submit("c", list(range(1, 9)), 2, clock(), prefilled=True)
    assert eng.abort("c", clock())  # aborted while waiting: its preallocated pages go back
    assert eng.stats().used_tokens == 0


def test_a_pd_decode_request_whose_kv_is_in_is_not_held_behind_one_waiting_for_memory():
    """Preallocated requests hold their memory already: a request ahead of them that waits for memory
    must not block them (they would never free what it waits for)."""
    eng, _, clock = make()  # 100 pages of 4 tokens
    assert eng.prealloc("p", 200, 1)  # 50 pages held for p, whose KV is on the way
    assert not eng.prealloc("h", 300, 1)  # 75 pages: too many now, taken at admission
    eng.submit("h", prompt(300), 1, clock(), prefilled=True)  # h's KV came first
    eng.submit("p", prompt(200, start=5000), 1, clock(), prefilled=True)
    batch = eng.schedule(clock())
    assert batch is not None and [r.rid for r in batch.reqs] == ["p"]
    clock.advance(batch.duration)
    eng.complete(batch, clock())
    run_until_idle(eng, clock, clock.advance)
    assert eng.stats().requests_finished_total == 2
