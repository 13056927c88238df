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

import numpy as np

from serve_app.policies.base import Decision, RouteRequest, WorkerView, _raise_none
from serve_app.policies.fleet import FleetView

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


_INF = float("inf")
_NUMPY_FROM = 48  # fleets at least this large are scored with numpy (fixed overhead ≈ 10 µs)


class KvAware:
    """See the module docstring for the cost. Request-independent terms are computed once per
    worker view (cached across requests when the router passes a `FleetView`)."""

    name = "kv_aware"

    def __init__(self, config: KvAwareConfig | None = None) -> None:
        self.config = config or KvAwareConfig()

    def row(self, w: WorkerView, block_tokens: int) -> tuple[float, float, float, float]:
        """(down, base, headroom, capacity_tokens) of one worker: cost(new) =
        scale·(base + (prefill_weight+1)·new + kv_overflow_weight·max(0, new − headroom))."""
        cfg = self.config
        ps = w.page_size / block_tokens
        kv0 = w.kv_active_blocks * ps + w.pending_kv_blocks
        base = cfg.prefill_weight * (w.pending_prefill_blocks + cfg.remote_request_blocks * w.remote_pending) + kv0
        q = w.waiting
        if w.total_slots:
            extra = w.running + w.pending + w.remote_pending + 1 - w.total_slots
            if extra > 0:
                q += extra
        base += cfg.queued_request_blocks * q
        if w.kv_total_blocks:
            headroom = cfg.kv_high_watermark * w.kv_total_blocks * ps - kv0
            cap = float(w.kv_total_blocks * w.page_size)
        else:
            headroom, cap = _INF, 0.0
        return (1.0 if w.state == "down" else 0.0, base, headroom, cap)

    def costs(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, float]:
        """Normalised cost per routable worker (for inspection, tests and `/route` debugging)."""
        cost, _ = self._score(request, workers, force_python=True)
        return {w.name: c for w, c in zip(workers, cost) if c != _INF}

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        cfg = self.config
        cost, affine = self._score(request, workers)
        best = float(cost.min()) if isinstance(cost, np.ndarray) else min(cost, default=_INF)
        if best == _INF:
            _raise_none(workers)
        P = request.prompt_blocks
        if affine:
            limit = best * (1.0 + cfg.tolerance) + cfg.tolerance_blocks + _EPS
            pick_i, pick_o, pick_c, ties = -1, 0, _INF, 0
            for i, o in affine:
                c = float(cost[i])
                if c > limit:
                    continue
                if o > pick_o or (o == pick_o and c < pick_c - _EPS):
                    pick_i, pick_o, pick_c, ties = i, o, c, 1
                elif o == pick_o and c <= pick_c + _EPS:
                    ties += 1  # reservoir sampling keeps the draw uniform among equals
                    if rng.random() * ties < 1.0:
                        pick_i = i
            if pick_i >= 0:
                w = workers[pick_i]
                return Decision(
                    w.name, w.url, self.name,
                    f"overlap={pick_o}/{P} blocks, cost={pick_c:.1f} (min {best:.1f})",
                )
        lim = best + _EPS
        if isinstance(cost, np.ndarray):
            mins = np.flatnonzero(cost <= lim)
            i = int(mins[0]) if len(mins) == 1 else rng.choice(mins.tolist())
        else:
            mins = [i for i, c in enumerate(cost) if c <= lim]
            i = mins[0] if len(mins) == 1 else rng.choice(mins)
        w = workers[i]
        o = min(request.overlap.get(w.name, 0), P) if request.overlap else 0
        return Decision(
            w.name, w.url, self.name,
            f"overlap={o}/{P} blocks, cost={best:.1f} = min of {len(workers)}"
            + (f" ({len(mins)} tied)" if len(mins) > 1 else ""),
        )

    def _score(
        self, request: RouteRequest, workers: Sequence[WorkerView], force_python: bool = False
    ) -> tuple[list[float] | np.ndarray, list[tuple[int, int]]]:
        """Cost per position in `workers` (inf for down ones) and (position, overlap) of affine ones."""
        cfg = self.config
        B = request.block_tokens
        P = request.prompt_blocks
        k = cfg.prefill_weight + 1.0
        ow = cfg.kv_overflow_weight
        min_o = max(1, cfg.min_overlap_blocks)
        ovmap = request.overlap
        if isinstance(workers, FleetView):
            cols = workers.derived((id(self), B), lambda w: self.row(w, B))
            rows = cols.rows
            scale = cols.extra.get("scale", False)
            if scale is False:
                scale = cols.extra["scale"] = self._scales(rows)
            affine: list[tuple[int, int]] = []
            for name, o in ovmap.items():
                i = workers.position(name)
                if i is not None and o >= min_o and not rows[i][0]:
                    affine.append((i, min(o, P)))
            if len(rows) >= _NUMPY_FROM and not force_python:
                down, base, headroom, _cap = cols.arrays
                cost = base + k * P
                hmin = cols.extra.get("hmin")
                if hmin is None:
                    hmin = cols.extra["hmin"] = float(headroom.min())
                if P > hmin:
                    cost += ow * np.maximum(P - headroom, 0.0)
                if scale is not None:
                    cost *= scale[1]
                if down.any():
                    cost[down > 0] = _INF
                for i, o in affine:
                    _, b, hr, _ = rows[i]
                    new = P - o
                    c = b + k * new + (ow * (new - hr) if new > hr else 0.0)
                    cost[i] = c * scale[0][i] if scale is not None else c
                return cost, affine
            out = self._eval(rows, P, k, ow, scale[0] if scale is not None else None)
            for i, o in affine:
                _, b, hr, _ = rows[i]
                new = P - o
                c = b + k * new + (ow * (new - hr) if new > hr else 0.0)
                out[i] = c * scale[0][i] if scale is not None else c
            return out, affine
        rows = [self.row(w, B) for w in workers]
        scale = self._scales(rows)
        out = self._eval(rows, P, k, ow, scale[0] if scale is not None else None)
        affine = []
        if ovmap:
            for i, w in enumerate(workers):
                o = ovmap.get(w.name, 0)
                if o >= min_o and not rows[i][0]:
                    o = min(o, P)
                    affine.append((i, o))
                    _, b, hr, _ = rows[i]
                    new = P - o
                    c = b + k * new + (ow * (new - hr) if new > hr else 0.0)
                    out[i] = c * scale[0][i] if scale is not None else c
        return out, affine

    @staticmethod
    def _eval(rows: list[tuple[float, float, float, float]], P: int, k: float, ow: float,
              scale: list[float] | None) -> list[float]:
        """Cost of every worker for a prompt of P blocks none of which it caches."""
        kp = k * P
        out: list[float] = []
        append = out.append
        for down, base, hr, _ in rows:
            if down:
                append(_INF)
                continue
            c = base + kp
            if P > hr:
                c += ow * (P - hr)
            append(c)
        if scale is not None:
            out = [c * s for c, s in zip(out, scale)]
        return out

    def _scales(self, rows: list[tuple[float, float, float, float]]) -> tuple[list[float], np.ndarray] | None:
        """Per-worker factor mean_cap / cap_w (1 for unknown capacity), or None when all are 1."""
        if not self.config.normalize_by_capacity:
            return None
        known = [r[3] for r in rows if r[3] > 0 and not r[0]]
        if not known or min(known) == max(known):
            return None
        mean = sum(known) / len(known)
        s = [mean / r[3] if r[3] > 0 else 1.0 for r in rows]
        return s, np.array(s, dtype=np.float64)
