"""Prefix indexes: longest held prefix per worker, bounded memory, exact mode from KV events."""

from __future__ import annotations

import random
import time

import pytest

from actors.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from serve_app.prefix_index import KvEventIndex, PrefixIndex, hash_token_blocks


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def chain(prefix: str, n: int) -> list[int]:
    """n chained block hashes; chains with the same `prefix` label share nothing with others."""
    return [hash((prefix, i)) for i in range(n)]


# -- approximate index --------------------------------------------------------------------------


def test_overlap_is_the_longest_recorded_prefix_per_worker():
    ix = PrefixIndex()
    conv = chain("c", 50)
    ix.record("a", conv[:10])
    ix.record("b", conv[:37])
    ix.record("c", chain("other", 50))
    assert ix.overlap(conv) == {"a": 10, "b": 37}
    assert ix.overlap(conv[:5]) == {"a": 5, "b": 5}
    assert ix.overlap(chain("nobody", 20)) == {}
    assert ix.overlap([]) == {}


def test_overlap_agrees_with_a_linear_scan_on_random_histories():
    rng = random.Random(7)
    ix = PrefixIndex()
    base = chain("p", 200)
    truth: dict[str, int] = {}
    for _ in range(300):
        w = f"w{rng.randrange(12)}"
        n = rng.randrange(1, 200)
        ix.record(w, base[:n])
        truth[w] = max(truth.get(w, 0), n)
    for n in (1, 7, 64, 199, 200):
        want = {w: min(k, n) for w, k in truth.items()}
        assert ix.overlap(base[:n]) == want


def test_entries_expire_after_ttl_per_worker():
    clock = Clock()
    ix = PrefixIndex(ttl_s=10, clock=clock)
    p = chain("p", 8)
    ix.record("a", p)
    clock.t = 6
    ix.record("b", p[:4])
    clock.t = 12  # a's use is 12 s old, b's 6 s
    assert ix.overlap(p) == {"b": 4}
    ix.record("c", p)
    clock.t = 15
    ix.record("c", p[:3])  # c refreshed only its first 3 blocks
    clock.t = 24
    assert ix.overlap(p) == {"c": 3}
    clock.t = 40
    ix.expire()
    assert ix.overlap(p) == {} and len(ix) == 0


def test_entry_count_is_capped_evicting_the_deepest_blocks_first():
    ix = PrefixIndex(max_entries=100)
    long_prompt = chain("long", 80)
    ix.record("a", long_prompt)
    ix.record("b", chain("other", 50))  # 130 > 100: 30 entries must go
    assert len(ix) == 100
    assert ix.overlap(long_prompt) == {"a": 50}  # its tail was evicted, its head kept
    for _ in range(20):
        ix.record("c", chain(f"x{_}", 40))
    assert len(ix) == 100


def test_a_shared_prefix_refreshed_by_later_prompts_outlives_their_tails():
    ix = PrefixIndex(max_entries=60)
    system = chain("sys", 20)
    for i in range(10):
        ix.record("a", system + chain(f"q{i}", 10))
    assert ix.overlap(system) == {"a": 20}


def test_remove_worker_forgets_only_that_worker():
    ix = PrefixIndex()
    p = chain("p", 10)
    ix.record("a", p)
    ix.record("b", p)
    ix.remove_worker("a")
    assert ix.overlap(p) == {"b": 10}
    ix.remove_worker("b")
    assert len(ix) == 0


def test_lookup_cost_does_not_grow_with_workers_times_blocks():
    ix = PrefixIndex(max_entries=1_000_000)
    prompt = chain("hot", 256)
    for i in range(1000):
        ix.record(f"w{i}", chain(f"own{i}", 64))
    for i in range(8):
        ix.record(f"w{i}", prompt[: 32 * (i + 1)])
    ix.overlap(prompt)
    start = time.perf_counter()
    for _ in range(200):
        out = ix.overlap(prompt)
    per_lookup = (time.perf_counter() - start) / 200
    assert out == {f"w{i}": 32 * (i + 1) for i in range(8)}
    assert per_lookup < 300e-6


# -- exact index from KV events -------------------------------------------------------------


def engine_events(tokens: list[int], page: int, salt: int = 0) -> list[BlockStored]:
    """What an engine would emit for caching `tokens`: one BlockStored per page, with its own
    (opaque to the router) hash chain."""
    out, parent = [], None
    for k in range(len(tokens) // page):
        eh = hash(("engine", salt, tuple(tokens[: (k + 1) * page])))
        out.append(BlockStored((eh,), parent, tuple(tokens[k * page : (k + 1) * page]), page))
        parent = eh
    return out


def test_exact_index_matches_prompts_hashed_from_their_token_ids():
    ix = KvEventIndex(block_tokens=4)
    shared = list(range(100, 116))  # 4 blocks
    ix.apply("a", engine_events(shared + [1, 2, 3, 4, 5, 6, 7, 8], 4))
    ix.apply("b", engine_events(shared, 4))
    prompt = shared + [1, 2, 3, 4, 9, 9, 9, 9, 9]
    assert ix.overlap(hash_token_blocks(prompt, 4)) == {"a": 5, "b": 4}


def test_exact_index_follows_removals_and_clears():
    ix = KvEventIndex(block_tokens=4)
    toks = list(range(16))
    evs = engine_events(toks, 4)
    ix.apply("a", evs)
    ix.apply("a", [BlockRemoved((evs[3].block_hashes[0], evs[2].block_hashes[0]))])
    assert ix.overlap(hash_token_blocks(toks, 4)) == {"a": 2}
    ix.apply("a", [AllBlocksCleared()])
    assert ix.overlap(hash_token_blocks(toks, 4)) == {} and len(ix) == 0


def test_exact_index_keeps_ranks_apart_and_counts_shared_blocks():
    ix = KvEventIndex(block_tokens=4)
    toks = list(range(8))
    ix.apply("a", engine_events(toks, 4), rank=0)
    ix.apply("a", engine_events(toks, 4, salt=1), rank=1)
    ix.apply("a", [AllBlocksCleared()], rank=1)  # rank 0 still holds them
    assert ix.overlap(hash_token_blocks(toks, 4)) == {"a": 2}
    ix.clear("a")
    assert ix.overlap(hash_token_blocks(toks, 4)) == {}


def test_exact_index_skips_blocks_it_cannot_place():
    ix = KvEventIndex(block_tokens=4)
    orphan = BlockStored((99,), 12345, (1, 2, 3, 4), 4)  # parent stored before we listened
    other_size = BlockStored((98,), None, tuple(range(8)), 8)
    ix.apply("a", [orphan, other_size])
    assert len(ix) == 0
    assert ix.unknown_parents == 1 and ix.skipped_blocks == 2


def test_exact_index_memory_is_bounded_per_source():
    ix = KvEventIndex(block_tokens=1, max_blocks_per_source=10)
    ix.apply("a", engine_events(list(range(50)), 1))
    assert len(ix) == 10 and ix.skipped_blocks == 40


def test_exact_mode_uses_the_callers_hasher_on_both_sides():
    h = lambda parent, toks: parent * 31 + sum(toks) + 1  # noqa: E731
    ix = KvEventIndex(block_tokens=2, hasher=h)
    ix.apply("a", engine_events([5, 6, 7, 8], 2))
    assert ix.overlap(hash_token_blocks([5, 6, 7, 8], 2, h)) == {"a": 2}
    assert ix.overlap(hash_token_blocks([5, 6, 7, 8], 2)) == {}


@pytest.mark.parametrize("n", [0, 3])
def test_hash_token_blocks_ignores_a_partial_tail(n):
    assert len(hash_token_blocks(list(range(16 + n)), 16)) == 1


def test_hot_blocks_are_the_ones_sent_to_a_worker_more_than_once():
    clock = Clock()
    ix = PrefixIndex(ttl_s=10, fresh_window_s=0, clock=clock)  # reuse only
    system = chain("sys", 20)
    ix.record("a", system + chain("q1", 3))
    assert ix.hot_blocks("a") == 0 and ix.take_changed() == set()  # one prompt: nothing reused yet
    ix.record("a", system + chain("q2", 3))  # same system prompt, another question
    assert ix.hot_blocks("a") == 20  # the shared part, not the questions' unique tails
    assert ix.take_changed() == {"a"} and ix.take_changed() == set()
    ix.record("b", system)  # another worker's first copy is not hot there
    assert (ix.hot_blocks("a"), ix.hot_blocks("b")) == (20, 0)
    ix.record("a", system)  # nothing new became hot
    assert ix.take_changed() == set()
    clock.t = 30.0  # everything expired
    ix.expire()
    assert (ix.hot_blocks("a"), len(ix)) == (0, 0)
    assert ix.take_changed() == {"a"}


def test_blocks_first_sent_lately_count_until_their_reuse_could_have_come():
    """A system prompt's first request looks like any unique prompt; for fresh_window_s its
    blocks count (its second request may be on the way), then only reuse keeps them hot."""
    clock = Clock()
    ix = PrefixIndex(ttl_s=120, hot_window_s=10, fresh_window_s=2, clock=clock)
    system = chain("sys", 20)
    ix.record("a", system + chain("q1", 3))
    assert ix.hot_blocks("a") == 23 and ix.take_changed() == {"a"}
    clock.t = 1.0
    ix.record("a", system + chain("q2", 3))  # reused: the system part is hot, no block counted twice
    assert ix.hot_blocks("a") == 20 + 3 + 3
    clock.t = 3.5  # the unique tails (sent at 0 and 1) were never reused
    ix.take_changed()
    assert ix.hot_blocks("a") == 20
    ix.record("b", chain("unique", 5))
    assert ix.take_changed() == {"b"} and ix.hot_blocks("b") == 5
    clock.t = 6.0
    assert ix.take_changed() == {"b"} and ix.hot_blocks("b") == 0


def test_hot_blocks_follow_lru_eviction_and_worker_removal():
    ix = PrefixIndex(max_entries=30)
    ix.record("a", chain("x", 20))
    ix.record("a", chain("x", 20))
    ix.record("b", chain("y", 20))  # 40 entries > 30: the LRU ones (x's deepest) go
    assert ix.hot_blocks("a") == 10
    ix.take_changed()
    ix.record("b", chain("y", 20))
    ix.remove_worker("b")
    assert ix.hot_blocks("b") == 0 and "b" in ix.take_changed()


def test_hot_blocks_cool_down_when_no_longer_reused():
    clock = Clock()
    ix = PrefixIndex(ttl_s=120, hot_window_s=10, clock=clock)
    convo = chain("conversation", 12)
    ix.record("a", convo)
    ix.record("a", convo)  # the next turn: hot
    assert ix.hot_blocks("a") == 12 and ix.take_changed() == {"a"}
    clock.t = 9.0
    assert ix.take_changed() == set() and ix.hot_blocks("a") == 12
    clock.t = 10.5  # the conversation ended 10.5 s ago: still indexed, no longer hot
    assert ix.take_changed() == {"a"} and ix.hot_blocks("a") == 0
    assert ix.overlap(convo) == {"a": 12}


# -- overlap as tiers ---------------------------------------------------------------------------


def test_a_prefix_the_whole_fleet_holds_comes_back_as_a_few_tiers_of_holder_sets():
    clock = Clock()
    ix = PrefixIndex(clock=clock)
    system = chain("system", 40)
    prompt = system + chain("question", 60)
    for i in range(2000):
        ix.record(f"w{i}", system + chain(f"own{i}", 5))
    for k in range(3):
        ix.record(f"w{k}", prompt[: 50 + 20 * k])
    ov = ix.overlap(prompt)
    assert [blocks for blocks, _ in ov.tiers] == [40, 50, 70, 90] and not ov.fixed
    assert len(ov) == 2000 and ov["w1999"] == 40 and ov.get("w2") == 90 and ov.get("nobody") is None
    assert ov == {**{f"w{i}": 40 for i in range(2000)}, "w0": 50, "w1": 70, "w2": 90}
    assert "w0" in ov and "nobody" not in ov


def test_holder_ids_follow_membership_changes():
    from serve_app.policies.overlap import worker_id

    ix = PrefixIndex(clock=Clock())
    p = chain("p", 4)
    ix.record("a", p)
    ix.record("b", p)
    ((_, holders),) = ix.overlap(p).tiers
    assert sorted(holders.ids().tolist()) == sorted([worker_id("a"), worker_id("b")])
    ix.record("a", p)  # a refresh: same members
    assert sorted(holders.ids().tolist()) == sorted([worker_id("a"), worker_id("b")])
    ix.record("c", p)
    assert sorted(holders.ids().tolist()) == sorted(worker_id(w) for w in "abc")
    ix.remove_worker("a")
    assert sorted(holders.ids().tolist()) == sorted(worker_id(w) for w in "bc")


def test_only_stale_holders_lose_their_overlap_whatever_order_they_were_refreshed_in():
    clock = Clock()
    ix = PrefixIndex(clock=clock, ttl_s=10.0)
    p = chain("p", 8)
    for w in ("a", "b", "c", "d"):
        ix.record(w, p)
        clock.t += 1
    clock.t += 5.0  # a, b, c, d last used at 0, 1, 2, 3; now 9
    ix.record("a", p[:3])  # a refreshes its first 3 blocks: fresh there, stale deeper
    clock.t += 2.5  # now 11.5: cutoff 1.5 → b (1) stale, c (2) and d (3) fresh
    assert ix.overlap(p) == {"a": 3, "c": 8, "d": 8}


# -- a worker's bounded cache: what was sent there long enough ago is evicted --------------------


def held(ix: PrefixIndex, prompt: list[int]) -> dict[str, int]:
    """`held_blocks` of every worker `overlap` names (those holding none left out)."""
    return {w: n for w in ix.overlap(prompt) if (n := ix.held_blocks(w, prompt))}


def test_a_prefix_is_trimmed_from_its_leaves_then_forgotten_as_newer_blocks_fill_the_cache():
    clock = Clock()
    ix = PrefixIndex(clock=clock)  # ttl 120 s: age alone forgets nothing here
    ix.set_capacity("a", 100)
    ix.set_capacity("b", 100)
    old = chain("old", 40)
    ix.record("a", old)
    ix.record("b", old)
    for i in range(6):  # 60 newer blocks on a: with `old`, exactly the 100 it can keep
        clock.t += 1
        ix.record("a", chain(f"n{i}", 10))
    assert held(ix, old) == {"a": 40, "b": 40}
    clock.t += 1
    ix.record("a", chain("n6", 10))  # 110: the LRU cache drops the 10 least recently used — old's leaves
    assert held(ix, old) == {"a": 30, "b": 40}
    assert ix.evicted_before("a") == float("-inf")
    for i in range(7, 10):
        clock.t += 1
        ix.record("a", chain(f"n{i}", 10))  # 30 more: the rest of old
    assert held(ix, old) == {"b": 40}
    assert ix.overlap(old) == {"a": 40, "b": 40}  # the claim that picks a worker keeps to ttl_s
    assert ix.evicted_before("a") == 0.0 and ix.evicted_before("b") == float("-inf")
    assert held(ix, chain("n0", 10)) == {"a": 10}  # the next oldest still fits


def test_blocks_reused_since_stay_and_take_room_only_once():
    clock = Clock()
    ix = PrefixIndex(clock=clock)
    ix.set_capacity("a", 50)
    system = chain("sys", 20)
    ix.record("a", system)

    def prompt(i: int) -> list[int]:
        return system + [hash(("tail", i, j)) for j in range(5)]

    for i in range(10):  # every prompt reuses the system prompt: 20 blocks held once, 5 new each
        clock.t += 1
        ix.record("a", prompt(i))
    assert held(ix, system) == {"a": 20}
    # 20 + 6 tails of 5 = 50 fit: the last six prompts' tails are held, the first four's are not
    assert [held(ix, prompt(i))["a"] for i in range(10)] == [20] * 4 + [25] * 6


def test_a_prompt_sent_back_after_its_eviction_takes_room_again():
    clock = Clock()
    ix = PrefixIndex(clock=clock)
    ix.set_capacity("a", 30)
    p, q = chain("p", 20), chain("q", 30)
    ix.record("a", p)
    clock.t = 1
    ix.record("a", q)  # 50 blocks for 30: p, the oldest, is out
    assert held(ix, p) == {} and held(ix, q) == {"a": 30}
    clock.t = 2
    ix.record("a", p)  # prefilled again: q, now the oldest, keeps its first 10 blocks
    assert held(ix, p) == {"a": 20} and held(ix, q) == {"a": 10}
    clock.t = 3
    ix.record("a", chain("r", 10))
    assert held(ix, p) == {"a": 20} and held(ix, q) == {}


def test_the_index_follows_a_simulated_lru_cache_on_random_traffic():
    """Against the engine's radix cache as an LRU cache of blocks (a prompt's blocks all used at
    once, its root last, so the deepest go first): what the index claims a worker holds is what an
    LRU cache of its capacity holds (prompts drawn from a few shared prefixes, so reuse, trimming
    and whole evictions all happen)."""
    from collections import OrderedDict
    from itertools import takewhile

    rng = random.Random(11)
    clock = Clock()
    cap = 120
    ix = PrefixIndex(clock=clock)
    ix.set_capacity("a", cap)
    lru: OrderedDict[int, None] = OrderedDict()
    roots = [chain(f"r{i}", 40) for i in range(6)]
    prompts = [roots[i % 6][: rng.randrange(5, 30)] + chain(f"p{i}", rng.randrange(0, 15)) for i in range(40)]
    checked = 0
    for _ in range(600):
        clock.t += 1
        p = prompts[rng.randrange(len(prompts))]
        for h in reversed(p):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)
        ix.record("a", p)
        for q in prompts:
            claimed = ix.held_blocks("a", q)
            assert claimed == sum(1 for _ in takewhile(lru.__contains__, q)), q
            checked += 0 < claimed < len(q)
    assert checked > 1000  # partly held prompts were compared, not only whole or empty ones


def test_without_a_capacity_only_age_forgets_and_a_cleared_capacity_stops_counting():
    clock = Clock()
    ix = PrefixIndex(clock=clock)
    old = chain("old", 10)
    ix.record("a", old)
    for i in range(50):
        clock.t += 0.1
        ix.record("a", chain(f"n{i}", 100))
    assert held(ix, old) == {"a": 10}  # no capacity known: 5,000 blocks later it is still claimed
    ix.set_capacity("a", 10)
    ix.set_capacity("a", None)  # unknown again (e.g. a report without the pool size)
    clock.t += 1
    ix.record("a", chain("m", 100))
    assert held(ix, old) == {"a": 10}
    clock.t += 200  # ttl_s still applies
    assert held(ix, old) == {}
