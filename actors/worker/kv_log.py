"""What an engine's prefix cache holds, from its KV events, and the log routers follow (pure).

The worker actor feeds decoded KV-event batches in (`apply`) and router replicas ask for everything
after their cursor (`since`). A cursor from another epoch or older than the retained log gets the
whole current state instead, so a follower is never silently wrong: it is either incremental or
rebuilt. A sequence gap from the engine (PUB drops at its high-water mark) clears that rank, like an
`AllBlocksCleared`: what we no longer know, we do not claim.
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any

from actors.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from actors.protocol import KvLogAnswer, KvLogEntry


class KvLog:
    def __init__(self, max_entries: int = 10_000, max_blocks: int = 2_000_000) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self.max_blocks = max_blocks
        self._log: deque[KvLogEntry] = deque(maxlen=max_entries)
        # rank → engine block hash → (parent hash, token ids, block size); insertion order = parents first
        self._blocks: dict[int, dict[int, tuple[int | None, tuple[Any, ...], int]]] = {}
        self.dropped_blocks = 0

    def apply(self, rank: int, events: tuple[KvEvent, ...]) -> int:
        """Record one batch of a rank; returns the new log sequence number."""
        blocks = self._blocks.setdefault(rank, {})
        for ev in events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                bs = ev.block_size
                for k, h in enumerate(ev.block_hashes):
                    if len(blocks) >= self.max_blocks:
                        self.dropped_blocks += 1
                        break
                    blocks[h] = (parent, tuple(ev.token_ids[k * bs:(k + 1) * bs]), bs, ev.lora_name)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    blocks.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()
        self.seq += 1
        self._log.append(KvLogEntry(self.seq, rank, events))
        return self.seq

    def lose_rank(self, rank: int) -> int:
        """The engine's stream had a gap or restarted: forget the rank (followers clear it too)."""
        return self.apply(rank, (AllBlocksCleared(),))

    def since(self, epoch: str | None, seq: int) -> KvLogAnswer:
        """Entries after `seq`, or (other epoch / cursor older than the log) the whole state."""
        oldest = self._log[0].seq if self._log else self.seq + 1
        if epoch == self.epoch and seq >= oldest - 1:
            entries = [e for e in self._log if e.seq > seq]
            return KvLogAnswer(epoch=self.epoch, seq=self.seq, full=False, entries=entries)
        return KvLogAnswer(epoch=self.epoch, seq=self.seq, full=True, entries=self.state_entries())

    def state_entries(self) -> list[KvLogEntry]:
        out = []
        for rank, blocks in self._blocks.items():
            events = tuple(
                BlockStored((h,), parent, tokens, bs, lora_name=lora)
                for h, (parent, tokens, bs, lora) in blocks.items()
            )
            out.append(KvLogEntry(self.seq, rank, events))
        return out

    def blocks(self, rank: int = 0) -> int:
        return len(self._blocks.get(rank, {}))
