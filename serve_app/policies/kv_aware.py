"""kv_aware: prefix-cache overlap and load in one cost (after NVIDIA Dynamo's KV router).

For each routable worker w, in blocks of B = `request.block_tokens` tokens:

    P        = ceil(prompt_tokens / B)                       blocks of this prompt
    o        = min(overlap[w], P)                            leading blocks w already caches
    new      = P − o                                         blocks w must prefill and allocate
    prefill  = pending_prefill_blocks + remote_request_blocks·remote_pending + new
    kv       = kv_active_blocks·page_size/B + pending_kv_blocks + new
    queued   = waiting + max(0, running + pending + remote_pending + 1 − total_slots)
                                                            (slot term only when total_slots > 0)
    over     = max(0, kv − kv_high_watermark·kv_total_blocks·page_size/B)
                                                            (only when kv_total_blocks > 0)
    raw      = prefill_weight·prefill + kv + queued_request_blocks·queued + kv_overflow_weight·over
    cost     = raw · mean_cap / cap_w                        cap_w = kv_total_blocks·page_size; mean over
                                                            routable workers that report one; workers
                                                            without one keep raw (normalize_by_capacity)

`running`, `waiting`, `kv_active_blocks` are the worker's last report (zero when `idle`); `pending*`
are this router's dispatches that report cannot show yet and `remote_pending` other replicas'
(see `serve_app.ledger`). Choice: let c* = min cost; the near set is every w with
cost ≤ c*·(1 + tolerance) + tolerance_blocks. If some near worker has o ≥ min_overlap_blocks, pick
the near worker with the largest o (then the lowest cost, then at random); otherwise pick at random
among the workers whose cost equals c*. Affinity therefore never beats load blindly: a hot prefix
stays on its worker while that worker is within tolerance of the best, and spreads once its
queue, slots or KV make it costlier.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from serve_app.policies.base import Decision, RouteRequest, WorkerView, _raise_none

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    """Every knob of kv_aware; costs are in prompt blocks of the router's block size."""

    prefill_weight: float = 1.0
    """Weight of blocks still to prefill against KV blocks held (Dynamo's prefill_load_scale)."""
    queued_request_blocks: float = 128.0
    """Cost of one request queued ahead: each reported waiting request and each one beyond the
    worker's slots (it waits for a running request to finish)."""
    remote_request_blocks: float = 32.0
    """Assumed prefill blocks of a request another router replica dispatched (size unknown)."""
    kv_high_watermark: float = 0.9
    """Fraction of KV capacity above which every further block costs `kv_overflow_weight` more."""
    kv_overflow_weight: float = 4.0
    """Extra cost per block over the watermark (the engine would queue, evict or retract)."""
    tolerance: float = 0.10
    """Relative slack: workers within c*·(1+tolerance) + tolerance_blocks count as near-minimum."""
    tolerance_blocks: float = 8.0
    """Absolute slack of the near-minimum set, in blocks."""
    min_overlap_blocks: int = 1
    """Overlap below this is not affinity (the near-minimum preference ignores it)."""
    normalize_by_capacity: bool = True
    """Scale cost by mean KV capacity / the worker's, so a 2× larger worker takes 2× the load."""

    def __post_init__(self) -> None:
        for f in ("prefill_weight", "queued_request_blocks", "remote_request_blocks",
                  "kv_overflow_weight", "tolerance", "tolerance_blocks"):
            if getattr(self, f) < 0:
                raise ValueError(f"KvAwareConfig.{f} must be ≥ 0, got {getattr(self, f)}")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError(f"KvAwareConfig.kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}")


class KvAware:
    name = "kv_aware"

    def __init__(self, config: KvAwareConfig | None = None) -> None:
        self.config = config or KvAwareConfig()

    def costs(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, float]:
        """Normalised cost per routable worker (for inspection, tests and `/route` debugging)."""
        ok, raw, _ = self._raw(request, workers)
        scale = self._scales(ok) or [1.0] * len(ok)
        return {w.name: c * s for w, c, s in zip(ok, raw, scale)}

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        cfg = self.config
        ok, raw, affine = self._raw(request, workers)
        scale = self._scales(ok)
        if scale is not None:
            cost = [c * s for c, s in zip(raw, scale)]
        else:
            cost = raw
        best = min(cost)
        P = request.prompt_blocks
        if affine:
            limit = best * (1.0 + cfg.tolerance) + cfg.tolerance_blocks
            pick_i, pick_o, ties = -1, 0, 0
            for i, o in affine:
                c = cost[i]
                if c > limit + _EPS:
                    continue
                if o > pick_o or (o == pick_o and c < cost[pick_i] - _EPS):
                    pick_i, pick_o, ties = i, o, 1
                elif o == pick_o and c <= cost[pick_i] + _EPS:
                    ties += 1  # reservoir sampling keeps the draw uniform among equals
                    if rng.random() * ties < 1.0:
                        pick_i = i
            if pick_i >= 0:
                w = ok[pick_i]
                return Decision(
                    w.name, w.url, self.name,
                    f"overlap={pick_o}/{P} blocks, cost={cost[pick_i]:.1f} (min {best:.1f})",
                )
        lim = best + _EPS
        mins = [i for i, c in enumerate(cost) if c <= lim]
        i = mins[0] if len(mins) == 1 else rng.choice(mins)
        w = ok[i]
        o = min(request.overlap.get(w.name, 0), P)
        return Decision(
            w.name, w.url, self.name,
            f"overlap={o}/{P} blocks, cost={best:.1f} = min of {len(ok)}"
            + (f" ({len(mins)} tied)" if len(mins) > 1 else ""),
        )

    def _raw(
        self, request: RouteRequest, workers: Sequence[WorkerView]
    ) -> tuple[list[WorkerView], list[float], list[tuple[int, int]]]:
        """Routable workers, their un-normalised cost, and (index, overlap) of the affine ones."""
        cfg = self.config
        B = request.block_tokens
        P = request.prompt_blocks
        ovmap = request.overlap
        min_o = max(1, cfg.min_overlap_blocks)
        pw = cfg.prefill_weight
        qb = cfg.queued_request_blocks
        rb = cfg.remote_request_blocks
        hw = cfg.kv_high_watermark
        ow = cfg.kv_overflow_weight
        ok: list[WorkerView] = []
        raw: list[float] = []
        affine: list[tuple[int, int]] = []
        for w in workers:
            if w.state == "down":
                continue
            o = ovmap.get(w.name, 0) if ovmap else 0
            if o:
                if o > P:
                    o = P
                if o >= min_o:
                    affine.append((len(ok), o))
            new = P - o
            ps = w.page_size / B
            kv = w.kv_active_blocks * ps + w.pending_kv_blocks + new
            c = pw * (w.pending_prefill_blocks + rb * w.remote_pending + new) + kv
            q = w.waiting
            if w.total_slots:
                extra = w.running + w.pending + w.remote_pending + 1 - w.total_slots
                if extra > 0:
                    q += extra
            if q:
                c += qb * q
            if w.kv_total_blocks:
                over = kv - hw * w.kv_total_blocks * ps
                if over > 0:
                    c += ow * over
            ok.append(w)
            raw.append(c)
        if not ok:
            _raise_none(workers)
        return ok, raw, affine

    def _scales(self, ok: list[WorkerView]) -> list[float] | None:
        """Per-worker factor mean_cap / cap_w, or None when the fleet is homogeneous (all 1)."""
        if not self.config.normalize_by_capacity:
            return None
        caps = [w.kv_total_blocks * w.page_size for w in ok]
        known = [c for c in caps if c > 0]
        if not known or min(known) == max(known):
            return None
        mean = sum(known) / len(known)
        return [mean / c if c > 0 else 1.0 for c in caps]
