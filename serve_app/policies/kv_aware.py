"""kv_aware: prefix-cache overlap and load in one cost (after NVIDIA Dynamo's KV router).

For each routable worker w, in blocks of B = `request.block_tokens` tokens:

    P        = ceil(prompt_tokens / B)                       blocks of this prompt
    o        = min(overlap[w], P)                            leading blocks w already caches
                                                            (0 if below min_overlap_blocks)
    new      = P − o                                         blocks w must prefill and allocate
    prefill  = pending_prefill_blocks + remote_request_blocks·remote_pending + new
    kv       = kv_active_blocks·page_size/B + pending_kv_blocks + new
    queued   = waiting + max(0, running + pending + remote_pending + 1 − total_slots)
                                                            (slot term only when total_slots > 0)
    over     = max(0, kv − kv_high_watermark·kv_total_blocks·page_size/B)
                                                            (only when kv_total_blocks > 0)
    room     = kv_total_blocks·page_size/B − max(kv_active_blocks·page_size/B + pending_kv_blocks,
                                                 hot_blocks)
    evict    = min(new, max(0, new − room))                  hot cached blocks this prompt pushes out
                                                            (only when kv_total_blocks > 0)
    raw      = prefill_weight·prefill + kv + queued_request_blocks·queued + kv_overflow_weight·over
               + eviction_weight·evict + followup_weight·recent_finished·new
    cost     = raw · mean_cap / cap_w                        cap_w = kv_total_blocks·page_size; mean over
                                                            routable workers that report one; workers
                                                            without one keep raw (normalize_by_capacity)

`running`, `waiting`, `kv_active_blocks` are the worker's last report (zero when `idle`); `pending*`
are this router's dispatches that report cannot show yet and `remote_pending` other replicas'
(see `serve_app.ledger`). `hot_blocks` are the blocks this router reused on w lately or first sent
there just now (`serve_app.prefix_index.PrefixIndex.hot_blocks`): prefixes that a new prompt would evict
and that would then be prefilled again, so a cold prompt goes where it displaces the least of them
(what keeps two hot system prompts from sharing a cache that holds one and a half).
`recent_finished` counts requests that finished on w within the ledger's follow-up window: their
next turns are about to arrive there and would wait behind this prompt's `new` blocks of prefill,
so a cold prompt avoids the worker whose conversations are between turns. Choice: let c* = min cost; the near set is every w with
cost ≤ c*·(1 + tolerance) + tolerance_blocks. If some near worker has o ≥ min_overlap_blocks, pick
the near worker with the largest o (then the lowest cost, then at random); otherwise pick at random
among the workers whose cost equals c*. Affinity therefore never beats load blindly: a hot prefix
stays on its worker while that worker is within tolerance of the best, and spreads once its
queue, slots or KV make it costlier.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from serve_app.policies.base import Decision, RouteRequest, WorkerView, _raise_none
from serve_app.policies.fleet import Columns, FleetView

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    """Every knob of kv_aware; costs are in prompt blocks of the router's block size."""

    prefill_weight: float = 4.0
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
    tolerance: float = 1.0
    """Relative slack: workers within c*·(1+tolerance) + tolerance_blocks count as near-minimum."""
    tolerance_blocks: float = 8.0
    """Absolute slack of the near-minimum set, in blocks."""
    min_overlap_blocks: int = 1
    """Overlap below this is not affinity (the near-minimum preference ignores it)."""
    normalize_by_capacity: bool = True
    """Scale cost by mean KV capacity / the worker's, so a 2× larger worker takes 2× the load."""
    eviction_weight: float = 5.0
    """Cost per hot cached block a prompt would evict (`evict`): they are prefilled again when
    their prefix comes back, so the default is one prefill (prefill_weight + 1 for its KV)."""
    followup_weight: float = 0.3
    """Cost per block of new prefill per request that finished on the worker within the
    ledger's follow-up window (expected follow-ups that would wait behind it)."""

    def __post_init__(self) -> None:
        for f in ("prefill_weight", "queued_request_blocks", "remote_request_blocks",
                  "kv_overflow_weight", "tolerance", "tolerance_blocks", "eviction_weight",
                  "followup_weight"):
            if getattr(self, f) < 0:
                raise ValueError(f"KvAwareConfig.{f} must be ≥ 0, got {getattr(self, f)}")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError(f"KvAwareConfig.kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}")


_INF = float("inf")
_EMPTY_I = np.zeros(0, dtype=np.intp)
_EMPTY_F = np.zeros(0, dtype=np.float64)
_NUMPY_FROM = 48  # fleets at least this large are scored with numpy (fixed overhead ≈ 10 µs)


class KvAware:
    """See the module docstring for the cost. Request-independent terms are computed once per
    worker view (cached across requests when the router passes a `FleetView`)."""

    name = "kv_aware"

    def __init__(self, config: KvAwareConfig | None = None) -> None:
        self.config = config or KvAwareConfig()

    def row(self, w: WorkerView, block_tokens: int) -> tuple[float, float, float, float, float, float]:
        """(down, base, headroom, capacity_tokens, room, per_new) of one worker: cost(new) =
        scale·(base + (prefill_weight + 1 + per_new)·new + kv_overflow_weight·max(0, new − headroom)
               + eviction_weight·min(new, max(0, new − room)))."""
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
            total = w.kv_total_blocks * ps
            headroom = cfg.kv_high_watermark * total - kv0
            room = total - max(kv0, w.hot_blocks)
            cap = float(w.kv_total_blocks * w.page_size)
        else:
            headroom, room, cap = _INF, _INF, 0.0
        return (1.0 if w.state == "down" else 0.0, base, headroom, cap, room,
                cfg.followup_weight * w.recent_finished)

    def costs(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, float]:
        """Normalised cost per routable worker (for inspection, tests and `/route` debugging)."""
        cost, _, _ = self._score(request, list(workers))
        return {w.name: c for w, c in zip(workers, cost) if c != _INF}

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        cfg = self.config
        cost, apos, aov = self._score(request, workers)
        vec = isinstance(cost, np.ndarray)
        best = float(cost.min()) if vec and len(cost) else min(cost, default=_INF)
        if best == _INF:
            _raise_none(workers)
        P = request.prompt_blocks
        if len(apos):
            # the affine worker among the near-minimum ones: most overlap, then cheapest, then random
            limit = best * (1.0 + cfg.tolerance) + cfg.tolerance_blocks + _EPS
            if isinstance(apos, np.ndarray):
                ca = cost[apos]
                near = ca <= limit
                ties: list[int] = []
                if near.any():
                    omax = aov[near].max()
                    cand = near & (aov == omax)
                    cmin = ca[cand].min()
                    ties = sorted(apos[cand & (ca <= cmin + _EPS)].tolist())
                    pick_o = int(omax)
            else:  # one plain pass (affine workers are few; generators cost more than the work)
                pick_o = -1
                cmin = _INF
                cand: list[int] = []
                for i, o in zip(apos, aov):
                    c = cost[i]
                    if c > limit or o < pick_o:
                        continue
                    if o > pick_o:
                        pick_o, cmin, cand = o, c, [i]
                    else:
                        cand.append(i)
                        if c < cmin:
                            cmin = c
                ties = cand if len(cand) < 2 else sorted(i for i in cand if cost[i] <= cmin + _EPS)
            if ties:
                i = ties[0] if len(ties) == 1 else rng.choice(ties)
                w = workers[i]
                return Decision(w.name, w.url, self.name,
                                ("overlap={}/{} blocks, cost={:.1f} (min {:.1f})", pick_o, P, float(cost[i]), best))
        lim = best + _EPS
        if vec:
            mins = np.flatnonzero(cost <= lim).tolist()
        else:
            mins = [i for i, c in enumerate(cost) if c <= lim]
        i = mins[0] if len(mins) == 1 else rng.choice(mins)
        w = workers[i]
        o = min(request.overlap.get(w.name, 0), P) if request.overlap else 0
        return Decision(w.name, w.url, self.name,
                        ("overlap={}/{} blocks, cost={:.1f} = min of {}{}", o, P, best, len(workers),
                         f" ({len(mins)} tied)" if len(mins) > 1 else ""))

    def _score(self, request: RouteRequest, workers: Sequence[WorkerView]) -> tuple[Any, Any, Any]:
        """(cost per position in `workers`, inf for down ones; positions of affine workers; their
        overlaps) — numpy arrays for large FleetViews, lists otherwise."""
        cfg = self.config
        B = request.block_tokens
        P = request.prompt_blocks
        k = cfg.prefill_weight + 1.0
        ow = cfg.kv_overflow_weight
        ew = cfg.eviction_weight
        min_o = max(1, cfg.min_overlap_blocks)
        ovmap = request.overlap
        if isinstance(workers, FleetView):
            cols = workers.derived((id(self), B), lambda w: self.row(w, B))
            rows = cols.rows
            if len(rows) >= _NUMPY_FROM:
                scale = cols.extra.get("scale", False)
                if scale is False:
                    scale = cols.extra["scale"] = self._scales_numpy(cols)
                return self._score_numpy(cols, workers, ovmap, P, k, ow, ew, min_o, scale)
            scale = cols.extra.get("scale", False)
            if scale is False:
                scale = cols.extra["scale"] = self._scales(rows)
            names = workers.names
        else:
            rows = [self.row(w, B) for w in workers]
            scale = self._scales(rows)
            names = [w.name for w in workers]
        out: list[float] = []
        apos: list[int] = []
        aov: list[int] = []
        append = out.append
        ovget = ovmap.get if ovmap else None
        i = -1
        for (down, b, hr, _, room, fu), name in zip(rows, names):
            i += 1
            if down:
                append(_INF)
                continue
            o = ovget(name, 0) if ovget is not None else 0
            if o >= min_o:
                if o > P:
                    o = P
                apos.append(i)
                aov.append(o)
                new = P - o
            else:
                new = P
            c = b + (k + fu) * new
            if new > hr:
                c += ow * (new - hr)
            if new > room:
                c += ew * (new - room if room > 0 else new)
            append(c)
        if scale is not None:
            out = [c * f for c, f in zip(out, scale)]
        return out, apos, aov

    @staticmethod
    def _score_numpy(cols: Columns, fleet: FleetView, ovmap: Any, P: int, k: float, ow: float, ew: float,
                     min_o: int, scale: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        down, base, headroom, _cap, room, fu = cols.arrays
        cost = base + (k + fu) * P
        hmin = cols.extra.get("hmin")
        if hmin is None:
            hmin = cols.extra["hmin"] = float(headroom.min())
            cols.extra["rmin"] = float(room.min())
        if P > hmin:
            cost += ow * np.maximum(P - headroom, 0.0)
        if P > cols.extra["rmin"]:
            cost += ew * np.clip(P - room, 0.0, P)
        if scale is not None:
            cost *= scale
        anydown = cols.extra.get("anydown")
        if anydown is None:
            anydown = cols.extra["anydown"] = bool(down.any())
        if anydown:
            cost[down > 0] = _INF
        m = len(ovmap)
        if not m:
            return cost, _EMPTY_I, _EMPTY_F
        pos = np.fromiter(map(fleet.position_or_minus_one, ovmap), np.intp, m)
        ov = np.fromiter(ovmap.values(), np.float64, m)
        keep = (pos >= 0) & (ov >= min_o)
        pos, ov = pos[keep], ov[keep]
        if anydown:
            keep = down[pos] == 0
            pos, ov = pos[keep], ov[keep]
        if len(pos):
            np.minimum(ov, P, out=ov)
            new = P - ov
            c = (base[pos] + (k + fu[pos]) * new + ow * np.maximum(new - headroom[pos], 0.0)
                 + ew * np.minimum(np.maximum(new - room[pos], 0.0), new))
            if scale is not None:
                c *= scale[pos]
            cost[pos] = c
        return cost, pos, ov

    def _scales_numpy(self, cols: Columns) -> np.ndarray | None:
        """`_scales` over cached columns, vectorised (recomputed after any row changes)."""
        if not self.config.normalize_by_capacity:
            return None
        down, _, _, cap, _, _ = cols.arrays
        known = cap[(cap > 0) & (down == 0)]
        if not len(known) or known.min() == known.max():
            return None
        return np.where(cap > 0, known.mean() / np.where(cap > 0, cap, 1.0), 1.0)

    def _scales(self, rows: list[tuple[float, ...]]) -> list[float] | None:
        """Per-worker factor mean_cap / cap_w (1 for unknown capacity), or None when all are 1."""
        if not self.config.normalize_by_capacity:
            return None
        known = [r[3] for r in rows if r[3] > 0 and not r[0]]
        if not known or min(known) == max(known):
            return None
        mean = sum(known) / len(known)
        return [mean / r[3] if r[3] > 0 else 1.0 for r in rows]
