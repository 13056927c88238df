"""Which worker likely holds which prompt prefix in its KV cache: block hash → workers.

Two indexes answer the same question, `overlap(block_hashes) -> {worker: leading blocks held}`:

- `PrefixIndex` (approximate): what this router sent where. `record(worker, hashes)` after each
  dispatch; entries expire after `ttl_s` and the least recently used are evicted beyond
  `max_entries`. Works with text-chunk hashes (`serve_app.request_facts`), needs no engine support.
- `KvEventIndex` (exact): what the engines report caching, fed with SGLang KV events
  (`actors.wire.kv_events`). Engine block hashes are SHA-256 chains over token ids with a namespace,
  not something a router should re-derive; instead the index re-hashes the `token_ids` every
  `BlockStored` carries with the router's own `hasher` and keeps engine hash → own hash only to
  follow parents and removals. So exact mode works whenever the router can tokenize prompts like
  the engine (same tokenizer and chat template; e.g. `sim.tokenizer` for simulated workers) and
  uses the engine's page size as block size: the router hashes the prompt's token ids with
  `hash_token_blocks(ids, block_tokens, hasher)` — the same hasher the index uses.

Both keep the invariant that a worker holding block i holds blocks 0..i (a radix cache evicts
leaves first; `record` refreshes a whole prefix at once and touches it root-last so LRU eviction
takes the deepest blocks first). `overlap` relies on it: the distinct held-prefix lengths are found
by bisection over the sizes of the nested holder sets, O(log blocks) dict probes per distinct match
length, and returned as tiers of those sets (`serve_app.policies.overlap.Overlap`) — not
O(workers × blocks), and not O(workers) either: a system prompt held by the whole fleet costs
the same as one held by a single worker.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from functools import partial
from itertools import islice, repeat, takewhile
from operator import is_
from typing import Callable, Iterable, Sequence

from actors.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from serve_app.policies.overlap import Holders, Overlap

log = logging.getLogger(__name__)

_NEVER = float("-inf")

BlockHasher = Callable[[int, Sequence[int]], int]
"""(parent block's hash — 0 for the first block —, this block's token ids) → this block's hash."""


def namespace_salt(lora_name: str | None) -> int:
    """What a LoRA adapter's block keys are XORed with in both indexes (0: the base model's own
    namespace). SGLang's radix cache keeps each adapter's KV apart (its `extra_key` holds the
    adapter's lora_id) and names the adapter in its KV events (`BlockStored.lora_name`), so a
    prefix cached for one adapter is never a hit for another or for the base model. Keyed per
    process, like the text hashes: the indexes and the requests are hashed in the same one."""
    return hash(("kvroute-lora", lora_name)) if lora_name else 0


def default_block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Chained hash of one token block: deterministic across processes (ints hash to themselves)."""
    return hash((parent, tuple(tokens)))


def hash_token_blocks(
    token_ids: Sequence[int], block_tokens: int, hasher: BlockHasher | None = None
) -> list[int]:
    """Chained hashes of the full `block_tokens`-sized blocks of `token_ids` (a partial tail is
    not a block, as in the engine's paged cache)."""
    h = hasher or default_block_hash
    out: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = h(parent, token_ids[start : start + block_tokens])
        out.append(parent)
    return out


def _tiers(n: int, holders: Callable[[int], Holders | None]) -> list[tuple[int, Holders]]:
    """The distinct match lengths of positions 0..n-1 as tiers `(length, holders(length − 1))`,
    shallowest first, given nested holder sets (holders(i) ⊇ holders(j) for i < j). Bisection
    compares set sizes only: no set is copied or differenced, whatever the number of holders."""
    if n <= 0:
        return []
    first = holders(0)
    if not first:
        return []
    last = holders(n - 1) if n > 1 else first
    n_last = len(last) if last else 0
    if n_last == len(first):
        return [(n, last)]  # type: ignore[list-item]
    # (lo, size at lo, hi, size at hi): positions lo < hi with size(lo) > size(hi)
    stack = [(0, len(first), n - 1, n_last)]
    bounds: list[int] = []  # positions p where size(p) > size(p + 1)
    while stack:
        lo, a, hi, b = stack.pop()
        if hi - lo == 1:
            bounds.append(lo)
            continue
        mid = (lo + hi) // 2
        e = holders(mid)
        m = len(e) if e else 0
        if m > a:  # nesting violated (should not happen): trust the smaller side
            m = a
        if m != a:
            stack.append((lo, a, mid, m))
        if m != b:
            stack.append((mid, m, hi, b))
    bounds.sort()
    out = [(p + 1, holders(p)) for p in bounds]
    if n_last:
        out.append((n, last))
    return out  # type: ignore[return-value]


class _Fresh:
    """A worker's blocks first sent there within `fresh_window_s`, as a count per sending (its time
    → how many of its blocks are still fresh), not a set of blocks: which blocks they are follows
    from the entries — a block is fresh for a worker iff the worker holds it, it is not hot there,
    and the sending its holder time names is still counted here (`PrefixIndex.record`). Saves a
    dict insertion per new block, and its removal when the window ends."""

    __slots__ = ("batches", "n")

    def __init__(self) -> None:
        self.batches: OrderedDict[float, int] = OrderedDict()  # sending time → fresh blocks of it, oldest first
        self.n = 0

    def drop(self, sent_at: float, blocks: int = 1) -> bool:
        """`blocks` blocks sent at `sent_at` are no longer fresh (reused, or forgotten); False if that
        sending's window already ended (the blocks had stopped counting then)."""
        c = self.batches.get(sent_at)
        if not c:
            return False
        d = c if blocks > c else blocks
        self.batches[sent_at] = c - d
        self.n -= d
        return True

    def cool(self, cutoff: float) -> bool:
        """Let go of the sendings before `cutoff`; True if that dropped blocks."""
        b = self.batches
        gone = 0
        while b and next(iter(b)) < cutoff:
            gone += b.popitem(last=False)[1]
        self.n -= gone
        return gone > 0


class _Held(Holders):
    """The holder set of `PrefixIndex` entries — one object shared by all the blocks a sending
    added (a prompt's unknown tail: `{worker: sent at}` for each of them), until one of those
    blocks changes. `refs` counts the entries that hold this object; one with `refs > 1` is
    copied before it is changed (copy on write). Saves an object per new block — most of a
    prompt's blocks are a tail nobody sends again — and lets expiry drop a whole sending's
    blocks at once (they stay adjacent in LRU order: a block that is touched is copied and moved)."""

    __slots__ = ("refs",)  # (set by whoever makes one: a Python __init__ would cost more than the rest)


class _Horizon:
    """One worker's cache as an LRU cache of `capacity` blocks, followed per sending (a `record` at
    one time): the blocks each sending was the last to use (`live`: time → count, oldest first) and
    how long its prompt was. A sending's blocks leave its count when a later one uses them again
    (they are more recent now: the shared, shallow ones), so the counts add up to the distinct
    blocks the worker should still hold (`held`), and a sending's own are the deepest blocks of its
    prompt. While `held` exceeds the capacity the oldest sending is trimmed from its deepest block
    up, as the engine's radix cache evicts leaves least recently used first: what is left of it
    is its blocks above `trim_from` (`trim_at` names it); once none is left, everything used at or
    before its time is gone (`before`). O(1) per block reused, O(1) amortised per sending."""

    __slots__ = ("capacity", "live", "length", "held", "before", "trim_at", "trim_from")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live: OrderedDict[float, int] = OrderedDict()  # sending time → blocks it last used
        self.length: dict[float, int] = {}  # sending time → its prompt's length in blocks
        self.held = 0  # the sum of `live`
        self.before = _NEVER  # blocks last used at or before this time are evicted
        self.trim_at = _NEVER  # the sending being trimmed: its blocks at positions ≥ trim_from are gone
        self.trim_from = 0

    def holds(self, last_used: float, position: int) -> bool:
        """Whether the block at `position` of a prompt, last used at `last_used`, is still held."""
        return last_used > self.before and (last_used != self.trim_at or position < self.trim_from)

    def release(self, last_used: float, lo: int, hi: int) -> None:
        """The blocks at positions lo..hi of a prompt, all last used at `last_used`, are used again
        now: they leave that sending's count (those it still holds: none if it was evicted, or
        sent before the capacity was known)."""
        c = self.live.get(last_used)
        if c is None:
            return
        n = hi - lo + 1
        if last_used == self.trim_at:  # only its blocks above trim_from are still held
            n = max(0, min(hi + 1, self.trim_from) - lo)
        self.held -= n
        if c > n:
            self.live[last_used] = c - n
            return
        del self.live[last_used]  # (c < n only for this very sending: a block repeated in its prompt)
        del self.length[last_used]
        if last_used == self.trim_at:  # the oldest, trimmed: what was left of it moved on
            self.before = last_used
        if c < n:
            self.held += n - c

    def add(self, now: float, blocks: int, length: int) -> None:
        """A sending at `now` used these many distinct blocks (new, back, or reused) of a prompt of
        `length` blocks."""
        live = self.live
        live[now] = live.get(now, 0) + blocks
        if length > self.length.get(now, 0):
            self.length[now] = length
        self.held += blocks
        while self.held > self.capacity and len(live) > 1:  # the newest sending always stays
            t, n = next(iter(live.items()))
            excess = self.held - self.capacity
            if n <= excess:  # all of it goes
                del live[t], self.length[t]
                self.before = t
                self.held -= n
                continue
            if self.trim_at != t:
                self.trim_at, self.trim_from = t, self.length[t]
            self.trim_from -= excess
            live[t] = n - excess
            self.held -= excess


class PrefixIndex:
    """Approximate prefix index of one router replica: block hash → {worker: last use}.

    Memory is bounded by `max_entries` block hashes (each with the few workers holding it; the
    blocks one sending added share one holder set, `_Held`); entries unused for `ttl_s` are
    dropped. `record` is O(blocks) — its unknown tail in a tight loop of setitems —, `overlap`
    O(log blocks) probes, expiry O(1) per sending's untouched run of blocks plus O(1) per other block.

    It also keeps, per worker, the *hot* blocks: those sent to that worker at least twice (reused
    while held, e.g. a shared system prompt or a conversation's history — not a prompt's unique
    tail) and reused within the last `hot_window_s` (a finished conversation stops being worth
    keeping long before its entries expire), plus the blocks first sent there within the last
    `fresh_window_s` (a system prompt's second request may be on its way: before it arrives the
    first copy looks like any unique prompt). `hot_blocks(worker)` is what a new prompt would push
    out of that worker's cache at a cost; kv_aware prices that eviction. `take_changed()` names
    the workers whose count moved.

    A worker's cache is bounded, so what was sent there long enough ago is gone whatever `ttl_s`
    says. Given a worker's capacity (`set_capacity`: the blocks its KV pool can keep — the router
    sets it from the pool size the worker reports), the index follows that cache as an LRU cache
    (`_Horizon`), and `held_blocks(worker, prompt)` says how much of a prompt it can still hold:
    what the router charges that worker's prefill with. `overlap` keeps the longer, ttl-only claim
    for choosing a worker (an engine trims an old prefix from its leaves, so its first blocks may
    still hit there; steering by the bounded claim cost p99 and hit rate live). Without the
    bound, a prompt whose prefix the worker evicted long ago counted as a small prefill there and
    the next requests stacked up behind a full one — on the Mooncake replay the index claimed
    ~4× the tokens the engines had cached (bench/results/standard-mooncake-7.md).
    """

    def __init__(
        self,
        *,
        ttl_s: float = 120.0,
        max_entries: int = 262_144,
        hot_window_s: float = 10.0,
        fresh_window_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_entries < 1 or hot_window_s <= 0 or not 0 <= fresh_window_s <= hot_window_s:
            # (fresh ≤ hot: a block that cooled out of hot can then never be mistaken for a fresh one, `_Fresh`)
            raise ValueError("PrefixIndex needs ttl_s > 0, max_entries ≥ 1, hot_window_s > 0, "
                             "0 ≤ fresh_window_s ≤ hot_window_s")
        self.ttl_s = ttl_s
        self.hot_window_s = hot_window_s
        self.fresh_window_s = fresh_window_s
        self._hot_swept_at = float("-inf")
        self.max_entries = max_entries
        self._clock = clock
        # hash → holders {worker: last use}, each ordered by last use (oldest first: the stale lead)
        self._entries: OrderedDict[int, _Held] = OrderedDict()  # LRU first
        # worker → {hash: last reuse} of blocks it was sent twice or more, oldest reuse first
        self._hot: dict[str, OrderedDict[int, float]] = {}
        # worker → its blocks sent there once, within fresh_window_s (counted per sending: `_Fresh`)
        self._fresh: dict[str, _Fresh] = {}
        self._changed: set[str] = set()
        # worker → its capacity horizon (`_Horizon`): blocks last used before its `before` are evicted
        self._horizon: dict[str, _Horizon] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def set_capacity(self, worker: str, blocks: int | None) -> None:
        """How many blocks `worker`'s cache can keep (None or ≤ 0: unknown — only `ttl_s` ages its
        entries). Changing it keeps the count; a larger one cannot bring back evicted blocks."""
        h = self._horizon.get(worker)
        if blocks is None or blocks <= 0:
            if h is not None:
                h.capacity = 1 << 62
            return
        if h is None:
            self._horizon[worker] = _Horizon(blocks)
        else:
            h.capacity = blocks

    def evicted_before(self, worker: str) -> float:
        """Blocks last sent to `worker` at or before this time are taken as evicted there."""
        h = self._horizon.get(worker)
        return h.before if h is not None else float("-inf")

    def hot_blocks(self, worker: str) -> int:
        """Blocks reused on `worker` lately or first sent there just now (see the class docstring)."""
        hot = self._hot.get(worker)
        fresh = self._fresh.get(worker)
        return (len(hot) if hot else 0) + (fresh.n if fresh is not None else 0)

    def reused_blocks(self, worker: str) -> int:
        """The part of `hot_blocks` that was reused lately (sent there twice or more), not just sent
        once: prefixes whose next requests are likely (shared system prompts, conversations)."""
        hot = self._hot.get(worker)
        return len(hot) if hot else 0

    def take_changed(self, now: float | None = None) -> set[str]:
        """Workers whose `hot_blocks` changed since the last call (reuse older than
        `hot_window_s` is let go here, at most every 0.1 s: O(workers) then)."""
        now = self._clock() if now is None else now
        if now - self._hot_swept_at >= 0.1:
            self._hot_swept_at = now
            for w, hot in self._hot.items():
                self._cool(w, hot, now, self.hot_window_s)
            cutoff = now - self.fresh_window_s
            for w, fresh in self._fresh.items():
                if fresh.cool(cutoff):
                    self._changed.add(w)
        c, self._changed = self._changed, set()
        return c

    def _cool(self, worker: str, hot: OrderedDict[int, float], now: float, window: float) -> None:
        cutoff = now - window
        # entries are in time order: count the expired lead, then drop it — both loops in C, no
        # iterator per entry
        n = len(list(takewhile(cutoff.__gt__, hot.values())))
        if n:
            deque(map(hot.popitem, repeat(False, n)), maxlen=0)
            self._changed.add(worker)

    def record(self, worker: str, block_hashes: Sequence[int], now: float | None = None) -> None:
        """`worker` was sent a prompt with these blocks: it will hold them (refreshes their use)."""
        now = self._clock() if now is None else now
        entries = self._entries
        move = entries.move_to_end
        hot = self._hot.get(worker)
        if hot is None:
            hot = self._hot[worker] = OrderedDict()
            self._fresh[worker] = _Fresh()
        fresh = self._fresh[worker]
        n_hot, n_fresh = len(hot), fresh.n
        hot_move = hot.move_to_end
        # the blocks nobody was sent yet are a chained prompt's tail (found by a C loop): insert them
        # in a tight loop, all holding one `_Held` — the entries, their order and their holders are
        # what the general loop below would make of them one by one
        n = len(block_hashes)
        tail = 0
        if n > 1 and block_hashes[-1] not in entries:
            try:
                tail = list(map(entries.__contains__, reversed(block_hashes))).index(True)
            except ValueError:
                tail = n
            new = block_hashes[n - tail:]
            if tail > 1 and len(set(new)) == tail:  # (a block repeated in it: the loop sorts that out)
                held = _Held()
                held[worker] = now
                held.refs = tail
                for h in reversed(new):  # (a loop of setitems beats `OrderedDict.update`'s C loop)
                    entries[h] = held
                block_hashes = block_hashes[: n - tail]
            else:
                tail = 0
        horizon = self._horizon.get(worker)
        # the blocks it already held, as runs of one last use each (a held prefix's use times only
        # grow towards its root): run_at over positions run_lo..run_hi, released to `horizon` per run
        i = len(block_hashes)  # the position of each block left to the loop, deepest first
        run_at, run_lo, run_hi = _NEVER, 0, -1
        added = tail  # blocks first sent to `worker` now: fresh from now on (one count for all of them)
        for h in reversed(block_hashes):  # root last: it becomes the most recently used
            i -= 1
            e = entries.get(h)
            if e is None:
                e = entries[h] = _Held()
                e.refs = 1
                e[worker] = now
                added += 1
            else:
                if e.refs > 1:  # shared with the other blocks of its sending: this one changes alone
                    e.refs -= 1
                    e = entries[h] = _Held(e)
                    e.refs = 1
                if worker in e:
                    if e[worker] != run_at:
                        if run_hi >= 0 and horizon is not None:
                            horizon.release(run_at, run_lo, run_hi)
                        run_at, run_hi = e[worker], i
                    run_lo = i
                    if h in hot:
                        hot[h] = now
                        hot_move(h)
                    else:  # sent again: hot now, and no longer fresh if it still was
                        sent_at = e[worker]  # (not hot: its holder time is still its first sending's)
                        hot[h] = now
                        if sent_at == now and added:
                            added -= 1  # first sent in this very prompt (a block repeated)
                        else:
                            fresh.drop(sent_at)
                    if len(e) > 1:
                        del e[worker]  # re-inserted last: holders stay in order of last use
                else:
                    added += 1
                    e.membership_changed()
                e[worker] = now
                move(h)
        if added and self.fresh_window_s > 0:
            fresh.batches[now] = fresh.batches.get(now, 0) + added
            fresh.n += added
        if len(hot) != n_hot or fresh.n != n_fresh:
            self._changed.add(worker)
        if horizon is not None:
            if run_hi >= 0:
                horizon.release(run_at, run_lo, run_hi)
            horizon.add(now, n, n)  # (n: the whole prompt, its new tail included)
        self._evict(now)

    def overlap(self, block_hashes: Sequence[int], now: float | None = None) -> Overlap:
        """Per worker, how many leading blocks of this prompt it holds (workers with none absent)."""
        if not block_hashes:
            return Overlap()
        now = self._clock() if now is None else now
        cutoff = now - self.ttl_s
        get = self._entries.get
        tiers = _tiers(len(block_hashes), lambda i: get(block_hashes[i]))
        fixed: dict[str, int] = {}
        # use times only decrease along a prompt, so a worker is stale somewhere iff it is stale at
        # its deepest block; holders are ordered by last use, so the stale ones of a block lead its
        # set. Deepest tier first: a worker's first stale sighting is at its deepest block.
        for k, e in reversed(tiers):
            for w, t in e.items():
                if t >= cutoff:
                    break
                if w in fixed:
                    continue
                lo, hi = 0, k - 1  # bisect its deepest fresh block: the fresh length is in [lo, hi]
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if get(block_hashes[mid - 1], {}).get(w, cutoff - 1) >= cutoff:
                        lo = mid
                    else:
                        hi = mid - 1
                fixed[w] = lo
        return Overlap(tiers, fixed) if fixed else Overlap(tiers)

    def held_blocks(self, worker: str, block_hashes: Sequence[int], now: float | None = None) -> int:
        """How many leading blocks of this prompt `worker` can still hold: `overlap`'s claim for it,
        less what newer blocks have pushed out of its cache since (`set_capacity`). O(log blocks)."""
        if not block_hashes:
            return 0
        now = self._clock() if now is None else now
        hz = self._horizon.get(worker)
        cutoff = now - self.ttl_s
        get = self._entries.get
        lo, hi = 0, len(block_hashes)  # held use times only decrease along a prompt: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            e = get(block_hashes[mid - 1])
            t = e.get(worker) if e is not None else None
            if t is not None and t >= cutoff and (hz is None or hz.holds(t, mid - 1)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def remove_worker(self, worker: str) -> None:
        """Forget everything about `worker` (left the fleet, or down: its cache is gone). O(entries)."""
        dead = []
        for h, e in self._entries.items():
            if worker in e:  # (a shared holder set loses it once, for all its blocks)
                del e[worker]
                e.membership_changed()
            if not e:
                dead.append(h)
        for h in dead:
            del self._entries[h]
        self._horizon.pop(worker, None)
        hot, fresh = self._hot.pop(worker, None), self._fresh.pop(worker, None)
        if hot or (fresh is not None and fresh.n):
            self._changed.add(worker)

    def expire(self, now: float | None = None) -> None:
        """Drop entries unused for `ttl_s` (also done on every `record`)."""
        self._evict(self._clock() if now is None else now)

    def _evict(self, now: float) -> None:
        entries = self._entries
        excess = len(entries) - self.max_entries
        while excess > 0:
            excess -= self._drop_lead(excess)
        cutoff = now - self.ttl_s
        while entries:
            e = next(iter(entries.values()))
            if next(reversed(e.values())) >= cutoff:  # its last use (holders are in use order)
                return
            self._drop_lead(len(entries))

    def _drop_lead(self, at_most: int) -> int:
        """Drop the LRU entry — with the entries after it that share its holder set (one sending's
        untouched blocks), up to `at_most` in all — and what the index keeps about them elsewhere."""
        entries = self._entries
        h, e = next(iter(entries.items()))
        if e.refs == 1 or at_most == 1:
            del entries[h]
            e.refs -= 1
            self._forget(h, e)
            return 1
        # the run of entries holding `e` at the front, counted and dropped in C loops
        k = len(list(takewhile(partial(is_, e), islice(entries.values(), min(at_most, e.refs)))))
        deque(map(entries.popitem, repeat(False, k)), maxlen=0)
        e.refs -= k
        # a shared set's blocks were never sent again (that copies the set), so none is hot: they
        # only stop counting as fresh
        for w, t in e.items():
            fresh = self._fresh.get(w)
            if fresh is not None and fresh.drop(t, k):
                self._changed.add(w)
        return k

    def _forget(self, h: int, holders: Holders) -> None:
        for w, t in holders.items():
            hot = self._hot.get(w)
            if hot and hot.pop(h, None) is not None:
                self._changed.add(w)
            else:
                fresh = self._fresh.get(w)
                if fresh is not None and fresh.drop(t):  # (not hot: `t` is its first sending's time)
                    self._changed.add(w)


class KvEventIndex:
    """Exact prefix index from engine KV events, per worker (and attention-DP rank).

    Apply each decoded batch with `apply(worker, batch.events, rank=batch.dp_rank)`; on a sequence
    gap or restart (`actors.wire.kv_events.SeqTracker`) call `clear(worker, rank)` before applying. Blocks
    of a size other than `block_tokens`, or whose parent is unknown (stored before we listened), are
    skipped and counted: they could never match a prompt hashed by the router.
    """

    def __init__(
        self,
        block_tokens: int,
        *,
        hasher: BlockHasher | None = None,
        max_blocks_per_source: int = 4_000_000,
        holder_of: Callable[[str, int], str] | None = None,
    ) -> None:
        """`holder_of(worker, rank)` names the holder a rank's blocks count for (default: the worker;
        the router gives each attention-DP rank of a DP worker its own, `policies.base.target_name`)."""
        self.block_tokens = block_tokens
        self._holder_of = holder_of or (lambda worker, rank: worker)
        self._hash = hasher or default_block_hash
        self.max_blocks_per_source = max_blocks_per_source
        # own hash → {worker: number of (rank, engine hash) entries holding it}
        self._holders: dict[int, Holders] = {}
        # (worker, rank) → engine hash → own hash
        self._sources: dict[tuple[str, int], dict[int, int]] = {}
        self.skipped_blocks = 0  # counters for /metrics
        self.unknown_parents = 0

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, worker: str, events: Iterable[KvEvent], rank: int = 0) -> None:
        src = self._sources.get((worker, rank))
        if src is None:
            src = self._sources[(worker, rank)] = {}
        holder = self._holder_of(worker, rank)
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(holder, src, ev)
            elif isinstance(ev, BlockRemoved):
                for eh in ev.block_hashes:
                    own = src.pop(eh, None)
                    if own is not None:
                        self._drop(holder, own)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(worker, rank)

    def _stored(self, worker: str, src: dict[int, int], ev: BlockStored) -> None:
        bs = ev.block_size
        n = len(ev.block_hashes)
        if bs != self.block_tokens or len(ev.token_ids) < n * bs:
            self.skipped_blocks += n
            return
        # a LoRA adapter's blocks are keyed in its namespace (`namespace_salt`): the chain is hashed as
        # the router hashes a prompt, each key XORed with the salt (a parent's key unsalted again)
        salt = namespace_salt(ev.lora_name)
        if ev.parent_block_hash is None:
            parent = 0
        else:
            parent = src.get(ev.parent_block_hash)
            if parent is None:
                self.unknown_parents += 1
                self.skipped_blocks += n
                return
            parent ^= salt
        toks = ev.token_ids
        holders = self._holders
        for k, eh in enumerate(ev.block_hashes):
            chain = self._hash(parent, toks[k * bs : (k + 1) * bs])
            own = chain ^ salt
            if eh not in src:
                if len(src) >= self.max_blocks_per_source:
                    self.skipped_blocks += n - k
                    return
                src[eh] = own
                e = holders.get(own)
                if e is None:
                    e = holders[own] = Holders()
                if worker in e:
                    e[worker] += 1
                else:
                    e[worker] = 1
                    e.membership_changed()
            parent = chain

    def _drop(self, worker: str, own: int) -> None:
        e = self._holders.get(own)
        if e is None:
            return
        c = e.get(worker, 0) - 1
        if c > 0:
            e[worker] = c
        else:
            if e.pop(worker, None) is not None:
                e.membership_changed()
            if not e:
                del self._holders[own]

    def clear(self, worker: str, rank: int | None = None) -> None:
        """Drop what `worker` (one rank, or all its ranks) holds: cleared cache, gap, or restart."""
        keys = [k for k in self._sources if k[0] == worker and (rank is None or k[1] == rank)]
        for k in keys:
            holder = self._holder_of(*k)
            for own in self._sources.pop(k).values():
                self._drop(holder, own)

    def remove_worker(self, worker: str) -> None:
        self.clear(worker)

    def blocks(self, worker: str) -> int:
        """Engine blocks of `worker` (all its ranks) held in the index — what its KV events said it caches."""
        return sum(len(src) for (w, _), src in self._sources.items() if w == worker)

    def overlap(self, block_hashes: Sequence[int]) -> Overlap:
        """Per worker, how many leading blocks of this prompt it caches (workers with none absent)."""
        get = self._holders.get
        return Overlap(_tiers(len(block_hashes), lambda i: get(block_hashes[i])))
