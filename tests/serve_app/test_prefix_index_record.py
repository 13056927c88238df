"""PrefixIndex's upkeep rewritten for speed — fresh blocks counted per sending instead of kept one
by one (`_Fresh`), `_cool` dropping expired hot entries in C loops, a prompt's unknown tail sharing
one holder set (`_Held`, copied on write) and expired or evicted as a run — leaves the index exactly
as the block-by-block code it replaced: same entries in the same LRU order, same holders in the same
use order, same hot blocks, same hot and fresh counts, same changed workers, same answers — on
random histories (LRU eviction and TTL expiry cutting through shared runs included), against a copy
of the old code. (`OrderedDict.update` was measured slower than a Python loop of setitems: the
tail is inserted by the loop.)"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from serve_app.policies.overlap import Holders
from serve_app.prefix_index import PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class WalkingIndex(PrefixIndex):
    """The index as it was: each entry its own holder set, evicted and expired entry by entry; each
    worker's fresh blocks a set of them (hash → first sent), added and removed block by block;
    `_cool` one entry at a time."""

    def hot_blocks(self, worker):
        hot = self._hot.get(worker)
        fresh = self._fresh.get(worker)
        return (len(hot) if hot else 0) + (len(fresh) if fresh else 0)

    def take_changed(self, now=None):
        now = self._clock() if now is None else now
        if now - self._hot_swept_at >= 0.1:
            self._hot_swept_at = now
            for w, hot in self._hot.items():
                self._cool(w, hot, now, self.hot_window_s)
            for w, fresh in self._fresh.items():
                self._cool(w, fresh, now, self.fresh_window_s)
        c, self._changed = self._changed, set()
        return c

    def _cool(self, worker, hot, now, window):
        cutoff = now - window
        n = len(hot)
        while hot and next(iter(hot.values())) < cutoff:
            hot.popitem(last=False)
        if len(hot) != n:
            self._changed.add(worker)

    def record(self, worker, block_hashes, now=None):
        now = self._clock() if now is None else now
        entries = self._entries
        move = entries.move_to_end
        hot = self._hot.get(worker)
        if hot is None:
            hot = self._hot[worker] = OrderedDict()
            self._fresh[worker] = OrderedDict()
        fresh = self._fresh[worker]
        n_hot, n_fresh = len(hot), len(fresh)
        hot_move = hot.move_to_end
        track_fresh = self.fresh_window_s > 0
        for h in reversed(block_hashes):
            e = entries.get(h)
            if e is None:
                e = entries[h] = Holders()
                e[worker] = now
                if track_fresh:
                    fresh[h] = now
            else:
                if worker in e:
                    if h in hot:
                        hot[h] = now
                        hot_move(h)
                    else:
                        hot[h] = now
                        fresh.pop(h, None)
                    if len(e) > 1:
                        del e[worker]
                else:
                    if track_fresh:
                        fresh[h] = now
                    e.membership_changed()
                e[worker] = now
                move(h)
        if len(hot) != n_hot or len(fresh) != n_fresh:
            self._changed.add(worker)
        self._evict(now)

    def remove_worker(self, worker):
        dead = []
        for h, e in self._entries.items():
            if e.pop(worker, None) is not None:
                e.membership_changed()
                if not e:
                    dead.append(h)
        for h in dead:
            del self._entries[h]
        hot, fresh = self._hot.pop(worker, None), self._fresh.pop(worker, None)
        if hot or fresh:
            self._changed.add(worker)

    def _evict(self, now):
        entries = self._entries
        while len(entries) > self.max_entries:
            self._forget(*entries.popitem(last=False))
        cutoff = now - self.ttl_s
        while entries:
            h, e = next(iter(entries.items()))
            if next(reversed(e.values())) >= cutoff:
                return
            del entries[h]
            self._forget(h, e)

    def _forget(self, h, holders):
        for w in holders:
            hot = self._hot.get(w)
            if hot and hot.pop(h, None) is not None:
                self._changed.add(w)
            fresh = self._fresh.get(w)
            if fresh and fresh.pop(h, None) is not None:
                self._changed.add(w)


def _state(ix: PrefixIndex) -> tuple:
    """Everything the index answers from: entries (LRU order, holders in use order), hot blocks per
    worker (reuse order), and each worker's hot and fresh counts."""
    workers = sorted(ix._hot)
    return ([(h, list(e.items())) for h, e in ix._entries.items()],
            {w: list(d.items()) for w, d in ix._hot.items()},
            [(w, ix.hot_blocks(w), ix.reused_blocks(w)) for w in workers])


def _prompt(rng: random.Random, families: int, odd: bool) -> list[int]:
    """A chained prompt: one of a few shared prefixes, then a tail of its own (sometimes none);
    with `odd`, now and then a block repeated or a hash from elsewhere, which no chain produces
    but callers may (the index's nesting, which `overlap` relies on, then no longer holds)."""
    f = rng.randrange(families)
    shared = [hash(("f", f, i)) for i in range(rng.randrange(0, 12))]
    tail_id = rng.randrange(10**9)
    blocks = shared + [hash(("t", tail_id, i)) for i in range(rng.randrange(0, 20))]
    if not odd:
        return blocks
    if blocks and rng.random() < 0.1:
        blocks.append(blocks[rng.randrange(len(blocks))])
    if rng.random() < 0.1:
        blocks.insert(rng.randrange(len(blocks) + 1), hash(("f", rng.randrange(families), rng.randrange(12))))
    return blocks


@pytest.mark.parametrize("seed", range(12))
def test_upkeep_leaves_the_index_exactly_as_the_entry_by_entry_code(seed):
    rng = random.Random(seed)
    hot_window = rng.choice([0.3, 10.0])
    kw = dict(ttl_s=rng.choice([0.5, 3.0, 120.0]), max_entries=rng.choice([40, 400, 100_000]),
              hot_window_s=hot_window, fresh_window_s=rng.choice([0.0, 0.2, min(2.0, hot_window), hot_window]))
    clock = Clock()
    new, old = PrefixIndex(clock=clock, **kw), WalkingIndex(clock=clock, **kw)
    workers = [f"w{i}" for i in range(rng.choice([1, 3, 6]))]
    odd = seed % 2 == 1
    prompts = [_prompt(rng, 4, odd) for _ in range(300)]
    for step in range(600):
        clock.t += rng.choice([0.0, 0.001, 0.05, 0.3])
        blocks = rng.choice(prompts) if rng.random() < 0.6 else _prompt(rng, 4, odd)
        worker = rng.choice(workers)
        new.record(worker, blocks)
        old.record(worker, blocks)
        if rng.random() < 0.2:
            assert new.take_changed() == old.take_changed()
        if rng.random() < 0.01:
            gone = rng.choice(workers)
            new.remove_worker(gone)
            old.remove_worker(gone)
        assert _state(new) == _state(old), f"step {step}"
        probe = rng.choice(prompts)
        if not odd:  # (overlap is a function of the state compared above; it needs the nesting)
            assert dict(new.overlap(probe)) == dict(old.overlap(probe))
        assert [new.hot_blocks(w) for w in workers] == [old.hot_blocks(w) for w in workers]
        assert [new.reused_blocks(w) for w in workers] == [old.reused_blocks(w) for w in workers]


def test_cooling_drops_exactly_the_entries_older_than_the_window_and_names_the_workers():
    clock = Clock()
    new, old = PrefixIndex(clock=clock, hot_window_s=1.0, fresh_window_s=0.5), \
        WalkingIndex(clock=clock, hot_window_s=1.0, fresh_window_s=0.5)
    for t, worker, blocks in [(0.0, "a", [1, 2, 3]), (0.2, "a", [1, 2]), (0.4, "b", [1, 9]), (0.6, "a", [1]),
                              (0.7, "b", [7, 8])]:
        clock.t = t
        for ix in (new, old):
            ix.record(worker, blocks)
    for t in (0.75, 0.95, 1.25, 1.65, 3.0):
        clock.t = t
        assert new.take_changed() == old.take_changed()
        assert _state(new) == _state(old)
        assert [new.hot_blocks(w) for w in "ab"] == [old.hot_blocks(w) for w in "ab"]
    assert new.hot_blocks("a") == new.hot_blocks("b") == 0


def test_a_fresh_window_longer_than_the_hot_window_is_refused():
    """(A block sent once cannot count as hot longer than a reused one; the per-sending count of
    fresh blocks relies on it.)"""
    from pydantic import ValidationError

    from serve_app.config import PrefixIndexConfig

    with pytest.raises(ValueError, match="fresh_window_s"):
        PrefixIndex(hot_window_s=1.0, fresh_window_s=2.0)
    with pytest.raises(ValidationError, match="fresh_window_s .* must not exceed hot_window_s"):
        PrefixIndexConfig(hot_window_s=1.0, fresh_window_s=2.0)
    assert PrefixIndexConfig(hot_window_s=2.0, fresh_window_s=2.0).fresh_window_s == 2.0
