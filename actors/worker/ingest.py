"""Per-worker ingest: frames → validated KvMetrics → latest value per DP rank, with counters.

Pure logic (no Ray, no sockets): the worker actor feeds it frames and reads `pending_report()`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.models import KvMetrics, tokens_to_blocks
from actors.protocol import RankMetrics
from actors.wire import WireError, decode_kv_metrics


@dataclass(slots=True)
class IngestStats:
    frames_received: int = 0
    frames_accepted: int = 0
    refused: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "frames_received": self.frames_received,
            "frames_accepted": self.frames_accepted,
            "frames_refused": sum(self.refused.values()),
            "refused_by_reason": dict(self.refused),
        }


class MetricsBook:
    """Latest KvMetrics per `data_parallel_rank`; `dirty` until the next report is taken."""

    def __init__(self, max_frame_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.clock = clock
        self.stats = IngestStats()
        self._latest: dict[int, tuple[KvMetrics, float, int]] = {}  # rank → (metrics, received at, seq)
        self._seq = 0
        self.dirty = False
        self.last_error: str | None = None

    def ingest(self, frame: bytes) -> KvMetrics | None:
        """Decode one frame; keep it if valid. Returns the metrics, or None if refused.

        The receive loop calls this once per frame, so it does nothing a frame does not need."""
        stats = self.stats
        stats.frames_received += 1
        try:
            m = decode_kv_metrics(frame, max_bytes=self.max_frame_bytes)
        except WireError as exc:
            self.refuse(exc.reason, str(exc))
            return None
        except Exception as exc:  # defence in depth: a decoder bug must cost one frame, not the loop
            self.refuse("decoder_error", f"{type(exc).__name__}")
            return None
        stats.frames_accepted += 1
        self._seq = seq = self._seq + 1
        self._latest[m.data_parallel_rank] = (m, self.clock(), seq)
        self.dirty = True
        return m

    def accept(self, m: KvMetrics) -> None:
        self.stats.frames_accepted += 1
        self._seq += 1
        self._latest[m.data_parallel_rank] = (m, self.clock(), self._seq)
        self.dirty = True

    def refuse(self, reason: str, detail: str) -> None:
        self.stats.refused[reason] += 1
        self.last_error = detail[:300]

    def ranks_report(self, page_size: int = 1) -> dict[int, dict[str, Any]]:
        """Every rank's latest values, KV counts converted from SGLang's tokens to blocks of
        `page_size`, with their age now and a change sequence number."""
        now = self.clock()
        out: dict[int, dict[str, Any]] = {}
        for rank, (m, received_at, seq) in self._latest.items():
            d = m.model_dump()
            d["kv_active_blocks"] = tokens_to_blocks(d["kv_active_blocks"], page_size)
            d["kv_total_blocks"] = tokens_to_blocks(d["kv_total_blocks"], page_size)
            d["age_s"] = now - received_at
            d["seq"] = seq
            out[rank] = d
        return out

    def rank_metrics(self, page_size: int = 1) -> list[RankMetrics]:
        """`ranks_report` as the `RankMetrics` a report carries, built straight from the latest values
        (no dict per rank: built for every push)."""
        now = self.clock()
        out = []
        for m, received_at, seq in self._latest.values():
            v = m.__dict__
            active, total = v["kv_active_blocks"], v["kv_total_blocks"]
            if page_size != 1:
                active, total = -(-active // page_size), -(-total // page_size)
            out.append(RankMetrics(v["request_active_slots"], v["request_total_slots"], active, total,
                                   v["num_requests_waiting"], v["gpu_cache_usage_perc"], v["gpu_prefix_cache_hit_rate"],
                                   v["data_parallel_rank"], now - received_at, seq))
        return out

    def heard_at(self) -> float | None:
        """When the newest accepted frame arrived (`clock` time), None before the first: while frames
        keep arriving the engine's scheduler is alive (passive liveness)."""
        latest = self._latest
        if not latest:
            return None
        if len(latest) == 1:
            for _, at, _ in latest.values():
                return at
        return max(at for _, at, _ in latest.values())

    def latest(self) -> dict[int, KvMetrics]:
        return {rank: entry[0] for rank, entry in self._latest.items()}

    def latest_with_times(self) -> dict[int, tuple[KvMetrics, float]]:
        """Every rank's latest report and when it arrived (`clock` time)."""
        return {rank: (entry[0], entry[1]) for rank, entry in self._latest.items()}
