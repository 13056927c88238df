"""The KV pool and its prefix cache: pages that are free, private to a request, or cached.

A cached page is a node of a tree keyed by SGLang's chained page digest (`sim.kv_events`), so
equal prefixes share pages. Requests lock the cached pages they use (`refs`); unlocked cached
pages are *evictable* and are evicted leaf-first, least recently used first, when an allocation
finds too few free pages — SGLang's radix cache at page granularity. Token counts follow SGLang's
accounting: `used = total − free − evictable`, counted in whole pages.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, event_hash


@dataclasses.dataclass(eq=False)
class CachedPage:
    digest: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    refs: int = 0
    children: int = 0
    last_access: float = 0.0


class KvPool:
    """`num_pages` pages of `page_size` tokens. Pure bookkeeping; raises nothing on normal use."""

    def __init__(self, num_pages: int, page_size: int, *, record_events: bool = False) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.record_events = record_events
        self.free_pages = num_pages
        self.cached: dict[bytes, CachedPage] = {}
        self.evictable_pages = 0  # cached pages with refs == 0
        self.evicted_pages_total = 0
        self.events: list[KvEvent] = []
        self._heap: list[tuple[float, int, bytes]] = []  # evictable leaves, lazily invalidated
        self._seq = 0

    # ------------------------------------------------------------------ accounting

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: free now, or after evicting unlocked cached pages."""
        return self.free_pages + self.evictable_pages

    @property
    def used_tokens(self) -> int:
        """SGLang's num_used: tokens neither free nor evictable (whole pages)."""
        return (self.num_pages - self.free_pages - self.evictable_pages) * self.page_size

    @property
    def evictable_tokens(self) -> int:
        return self.evictable_pages * self.page_size

    # ------------------------------------------------------------------ prefix matching

    def match(self, digests: Sequence[bytes]) -> int:
        """How many leading pages of a chain are cached."""
        n = 0
        for d in digests:
            if d not in self.cached:
                break
            n += 1
        return n

    def unlocked_count(self, digests: Sequence[bytes]) -> int:
        """How many of these cached pages are unlocked (locking them removes them from evictable)."""
        return sum(1 for d in digests if self.cached[d].refs == 0)

    def lock(self, digests: Sequence[bytes], now: float) -> None:
        for d in digests:
            page = self.cached[d]
            if page.refs == 0:
                self.evictable_pages -= 1
            page.refs += 1
            page.last_access = now

    def unlock(self, digests: Sequence[bytes], now: float) -> None:
        for d in reversed(digests):  # leaves first, so parents see their final child count
            page = self.cached[d]
            page.refs -= 1
            page.last_access = now
            if page.refs == 0:
                self.evictable_pages += 1
                if page.children == 0:
                    self._push_leaf(page)

    # ------------------------------------------------------------------ allocation

    def alloc(self, n: int) -> None:
        """Take `n` pages, evicting LRU unlocked cached pages if needed. Caller checked capacity."""
        if n > self.free_pages:
            self.evict(n - self.free_pages)
        if n > self.free_pages:
            raise RuntimeError(f"KV pool exhausted: need {n} pages, {self.free_pages} free")
        self.free_pages -= n

    def free(self, n: int) -> None:
        self.free_pages += n

    def evict(self, n: int) -> int:
        """Evict up to `n` unlocked cached pages, least recently used leaves first."""
        removed: list[int] = []
        while len(removed) < n and self._heap:
            last_access, _, digest = heapq.heappop(self._heap)
            page = self.cached.get(digest)
            if page is None or page.refs or page.children or page.last_access != last_access:
                continue  # stale entry
            del self.cached[digest]
            self.evictable_pages -= 1
            self.free_pages += 1
            removed.append(event_hash(digest))
            if page.parent is not None:
                parent = self.cached[page.parent]
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    self._push_leaf(parent)
        self.evicted_pages_total += len(removed)
        if removed and self.record_events:
            # SGLang ≤ 0.5.18 emits one BlockRemoved per page; the encoder merges for 0.5.20+
            self.events.extend(BlockRemoved(block_hashes=[h]) for h in removed)
        return len(removed)

    def _push_leaf(self, page: CachedPage) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (page.last_access, self._seq, page.digest))

    # ------------------------------------------------------------------ insertion

    def insert(
        self,
        digests: Sequence[bytes],
        token_ids: Sequence[int],
        start_page: int,
        now: float,
        *,
        lora_name: str | None = None,
    ) -> tuple[int, int]:
        """Cache pages `start_page …` of a chain whose pages the caller holds privately, locked.

        `digests[i]` is the digest of `token_ids[i*page : (i+1)*page]`; pages before
        `start_page` are already cached and locked by the caller. Each newly cached page is
        locked for the caller. Returns (pages moved from private to cached, pages that were
        already cached by someone else — the caller's private copy is freed here). `lora_name`: the
        adapter whose cache namespace the chain is in (its KV events name it, as 0.5.23's do).
        """
        moved = deduped = 0
        ps = self.page_size
        for i in range(start_page, len(digests)):
            d = digests[i]
            page = self.cached.get(d)
            if page is not None:
                if page.refs == 0:
                    self.evictable_pages -= 1
                page.refs += 1
                page.last_access = now
                self.free_pages += 1
                deduped += 1
                continue
            parent = digests[i - 1] if i > 0 else None
            tokens = tuple(token_ids[i * ps : (i + 1) * ps])
            self.cached[d] = CachedPage(d, parent, tokens, refs=1, last_access=now)
            if parent is not None:
                self.cached[parent].children += 1
            moved += 1
            if self.record_events:
                self.events.append(
                    BlockStored(
                        block_hashes=[event_hash(d)],
                        parent_block_hash=event_hash(parent) if parent is not None else None,
                        token_ids=list(tokens),
                        block_size=ps,
                        lora_name=lora_name,
                    )
                )
        return moved, deduped

    def clear(self) -> bool:
        """Drop every cached page (SGLang's flush_cache). Refused while any page is locked."""
        if any(p.refs for p in self.cached.values()):
            return False
        self.free_pages += len(self.cached)
        self.evictable_pages = 0
        self.cached.clear()
        self._heap.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
