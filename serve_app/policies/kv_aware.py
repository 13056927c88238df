"""kv_aware: prefix-cache overlap and load in one cost (after NVIDIA Dynamo's KV router).

For each routable worker w, in blocks of B = `request.block_tokens` tokens:

    P        = ceil(prompt_tokens / B)                       blocks of this prompt
    o        = min(overlap[w], P)                            leading blocks w already caches
                                                            (0 if below min_overlap_blocks)
    new      = P − o                                         blocks w must prefill and allocate
    prefill  = pending_prefill_blocks + remote_request_blocks·remote_pending
               + new·(1 + cobatch_weight·(prefilling + waiting))
                                                            every request before its first token there
                                                            waits for this prompt's prefill too
    kv       = kv_weight·(kv_active_blocks·page_size/B + pending_kv_blocks + new)
    queued   = waiting + max(0, running + pending + remote_pending + 1 − total_slots)
                                                            (slot term only when total_slots > 0)
    over     = max(0, kv − kv_high_watermark·kv_total_blocks·page_size/B)
                                                            (only when kv_total_blocks > 0)
    total    = kv_total_blocks·page_size/B
    room     = min(total − (kv_active_blocks·page_size/B + pending_kv_blocks),
                   kv_high_watermark·total − hot_blocks)
    evict    = min(new, max(0, new − room))                  hot cached blocks this prompt pushes out
                                                            (only when kv_total_blocks > 0)
    live     = hot_blocks · new / P                          live prefixes this cold share queues ahead of
    raw      = prefill_weight·prefill + kv + queued_request_blocks·queued + kv_overflow_weight·over
               + eviction_weight·evict + live_weight·live + followup_weight·recent_finished·new
    cost     = raw · mean_cap / cap_w                        cap_w = kv_total_blocks·page_size; mean over
                                                            routable workers that report one; workers
                                                            without one keep raw (normalize_by_capacity)

`running`, `waiting`, `kv_active_blocks` are the worker's last report (zero when `idle`); `pending`,
`pending_kv_blocks` this router's dispatches that report cannot show yet, `pending_prefill_blocks`
the prefill left of all its requests before their first token, and `remote_pending` other replicas'
dispatches (see `serve_app.ledger`). `hot_blocks` are the blocks this router reused on w lately or first sent
there just now (`serve_app.prefix_index.PrefixIndex.hot_blocks`): prefixes that a new prompt would evict
and that would then be prefilled again, so a cold prompt goes where it displaces the least of them
(what keeps two hot system prompts from sharing a cache that holds one and a half). The hot set
must leave (1 − kv_high_watermark) of the pool to the running requests' own blocks: a worker whose
hot prefixes already fill it to the watermark is full for another prefix even while its running
requests hold little. The same hot set prices *time*: the prefixes live on w (conversations,
shared system prompts) send their next requests there, and each would wait behind this prompt's
`new` blocks of prefill; hot_blocks / P estimates how many such sessions w carries (in units of
this prompt), so `live` charges a cold prompt for the sessions it would hold up and costs an affine
follow-up (small new / P) almost nothing. That is what sends a conversation's first turn to the
worker with the fewest conversations in flight rather than to the one that only looks idle
because its conversations are between turns.
`prefilling` counts this router's requests on w not yet past their first token: a prompt sent
there joins their prefill batch (SGLang prefills every waiting prompt that fits in one batch, and
each gets its first token when the batch ends), so its new blocks delay each of them as much as
itself. Pricing only its own wait is what made a greedy pick — even one with perfect information —
stack consecutive cold prompts into one batch on real traffic (`bench/results/mooncake.md`).
`recent_finished` counts requests that finished on w within the ledger's follow-up window (an
older, noisier estimate of the same thing; `followup_weight` is 0 by default).

Choice: let c* = min cost; the near set is every w with cost ≤ c*·(1 + tolerance) +
tolerance_blocks. If some near worker has o ≥ min_overlap_blocks, pick the near worker with the
largest o (then the lowest cost, then at random). Affinity therefore never beats load blindly: a
hot prefix stays on its worker while that worker is within tolerance of the best, and spreads once
its queue, slots or KV make it costlier. Otherwise, when no routable worker holds reused prefixes
(`reused_blocks`: nothing live to protect), workers take turns: of those with cost ≤
c*·(1 + turn_tolerance) + tolerance_blocks, the one this router routed to longest ago
(`last_routed_at`; ties at random) — identical cold requests then reach every worker evenly
spaced, as with round-robin, where cost differences are mostly report lag and a greedy pick,
even one with perfect information, has a longer tail. Else pick at random among the workers whose
cost equals c*.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable, Sequence

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
    live_weight: float = 4.0
    """Cost per hot block of the worker times this prompt's cold share (new / P): each live
    session there waits behind the new prefill, one prefill-weighted block per block of it."""
    cobatch_weight: float = 1.0
    """The delay a prompt adds to the others it is prefilled with: each request on the worker still
    before its first token (this router's, plus the reported waiting ones) waits for this prompt's
    new blocks too, so each new block costs prefill_weight·(1 + cobatch_weight·those requests).
    Greedy per-request cost otherwise sends consecutive cold prompts into one prefill batch
    (virtual-time Mooncake replay at 16 / 20 / 24 req/s, TTFT p50 266 → 236, 282 → 249, 311 → 299 ms;
    p99 969 → 891, 996 → 1,112, 1,126 → 1,234, still below round-robin's 966 / 1,205 / 1,648;
    designed workloads unchanged; `bench/results/mooncake.md`). 0 prices only the prompt's own wait."""
    kv_weight: float = 1.0
    """Cost per KV block held (the report's kv_active_blocks plus this router's pending ones)
    and per new block this prompt allocates."""
    followup_weight: float = 0.0
    """Cost per block of new prefill per request that finished on the worker within the
    ledger's follow-up window (expected follow-ups that would wait behind it). Off by default:
    `live_weight` estimates the same from the hot set, steadier than a 1-second count (virtual-time
    multi-turn TTFT p50 79 → 27 ms at 16 req/s, `bench/results/routesim.md`)."""
    turn_tolerance: float = 0.25
    """When no routable worker holds reused prefixes and the request goes to no affine worker,
    take turns: of the workers within c*·(1+turn_tolerance) + tolerance_blocks, the one this
    router sent a request to longest ago. Identical cold requests then reach each worker evenly
    spaced, as with round-robin, instead of by cost differences that are mostly report lag
    (virtual-time no-sharing TTFT p99 equal to round-robin's at 8–24 req/s, was up to 1.2×;
    `bench/results/routesim.md`). 0 disables it."""

    def __post_init__(self) -> None:
        for f in ("prefill_weight", "cobatch_weight", "kv_weight", "queued_request_blocks", "remote_request_blocks",
                  "kv_overflow_weight", "tolerance", "tolerance_blocks", "eviction_weight",
                  "live_weight", "followup_weight", "turn_tolerance"):
            if getattr(self, f) < 0:
                raise ValueError(f"KvAwareConfig.{f} must be ≥ 0, got {getattr(self, f)}")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError(f"KvAwareConfig.kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}")


_INF = float("inf")
_NUMPY_FROM = 64  # fleets at least this large are scored with numpy (fixed overhead ≈ 8–9 µs;
# measured crossover of the dense-overlap case on 3.11, `bench/decision.py`)

Row = tuple[float, float, float, float, float, float, float, float]


def _overlap_of(request: RouteRequest, worker: str) -> int:
    """Leading blocks of the prompt `worker` is believed to hold (for a decision's reason)."""
    return min(request.overlap.get(worker, 0), request.prompt_blocks) if request.overlap else 0


def _on_row_set(cols: Columns, old: Row, new: Row) -> None:
    """Keeps kv_aware's fleet-wide figures current when one worker's row changes: the capacity
    scale only depends on capacities and which workers are down; `hmin`/`rmin` stay lower bounds
    (a pre-check that is made exact again when it fires)."""
    ex = cols.extra
    if old[3] != new[3] or (old[0] == _INF) != (new[0] == _INF):
        ex.pop("scale", None)
    h = ex.get("hmin")
    if h is not None and new[2] < h:
        ex["hmin"] = new[2]
    r = ex.get("rmin")
    if r is not None and new[4] < r:
        ex["rmin"] = new[4]
    if new[5] and ex.get("anyhot") is False:
        ex["anyhot"] = True
    if new[6]:
        if ex.get("anyreused") is False:
            ex["anyreused"] = True
    elif old[6]:
        ex.pop("anyreused", None)  # maybe the last worker with reused prefixes: recount lazily


class KvAware:
    """See the module docstring for the cost. Request-independent terms are computed once per
    worker view (cached across requests when the router passes a `FleetView`)."""

    name = "kv_aware"

    def __init__(self, config: KvAwareConfig | None = None) -> None:
        self.config = config or KvAwareConfig()
        self._rowfns: dict[int, Callable[[WorkerView], Row]] = {}

    def row(self, w: WorkerView, block_tokens: int) -> Row:
        """(base, slope, headroom, capacity_tokens, room, hot, reused, last_routed_at) of one
        worker; base = inf and reused = 0 when it is down; room ≥ 0. Then
            cost(new) = scale·(base + (slope + live_weight·hot/P)·new
                               + kv_overflow_weight·max(0, new − headroom)
                               + eviction_weight·max(0, new − room))."""
        cfg = self.config
        ps = w.page_size / block_tokens
        kv0 = w.kv_active_blocks * ps + w.pending_kv_blocks
        base = cfg.prefill_weight * (w.pending_prefill_blocks + cfg.remote_request_blocks * w.remote_pending) \
            + cfg.kv_weight * kv0
        q = w.waiting
        if w.total_slots:
            extra = w.running + w.pending + w.remote_pending + 1 - w.total_slots
            if extra > 0:
                q += extra
        base += cfg.queued_request_blocks * q
        if w.kv_total_blocks:
            total = w.kv_total_blocks * ps
            headroom = cfg.kv_high_watermark * total - kv0
            room = max(0.0, min(total - kv0, cfg.kv_high_watermark * total - w.hot_blocks))
            cap = float(w.kv_total_blocks * w.page_size)
        else:
            headroom, room, cap = _INF, _INF, 0.0
        down = w.state == "down"
        return (_INF if down else base,
                cfg.prefill_weight * (1.0 + cfg.cobatch_weight * (w.prefilling + w.waiting)) + cfg.kv_weight
                + cfg.followup_weight * w.recent_finished, headroom, cap, room,
                float(w.hot_blocks), 0.0 if down else float(w.reused_blocks), w.last_routed_at)

    def _columns(self, fleet: FleetView, block_tokens: int) -> Columns:
        fn = self._rowfns.get(block_tokens)
        if fn is None:
            fn = self._rowfns[block_tokens] = lambda w: self.row(w, block_tokens)
        return fleet.derived((id(self), block_tokens), fn, _on_row_set)

    def costs(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, float]:
        """Normalised cost per routable worker (for inspection, tests and `/route` debugging)."""
        if isinstance(workers, FleetView) and len(workers) >= _NUMPY_FROM:
            cost, _ = self._cost_numpy(request, workers, self._columns(workers, request.block_tokens))
            cost = cost.tolist()
        else:
            rows = [self.row(w, request.block_tokens) for w in workers]
            cost, _ = self._score(request, rows, [w.name for w in workers], self._scales(rows))
        return {w.name: c for w, c in zip(workers, cost) if c != _INF}

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision:
        if isinstance(workers, FleetView):
            cols = self._columns(workers, request.block_tokens)
            rows = cols.rows
            if len(rows) >= _NUMPY_FROM:
                return self._choose_numpy(request, workers, cols, rng)
            ex = cols.extra
            scale = ex.get("scale", False)
            if scale is False:
                scale = ex["scale"] = self._scales(rows)
            names = workers.names
        else:
            rows = [self.row(w, request.block_tokens) for w in workers]
            scale = self._scales(rows)
            names = [w.name for w in workers]
            ex = {}
        cfg = self.config
        cost, ovs = self._score(request, rows, names, scale)
        best = min(cost, default=_INF)
        if best == _INF:
            _raise_none(workers)
        P = request.prompt_blocks
        if ovs is not None:
            # the affine worker among the near-minimum ones: most overlap, then cheapest, then
            # random — one plain pass (generators and key functions cost more than the work)
            limit = best * (1.0 + cfg.tolerance) + cfg.tolerance_blocks + _EPS
            floor = max(1, cfg.min_overlap_blocks)
            pick_o = 0
            cmin = _INF
            cand: list[int] = []
            i = -1
            for o in ovs:
                i += 1
                if o < floor:
                    continue
                c = cost[i]
                if c > limit:  # (down workers cost inf)
                    continue
                if o > P:
                    o = P
                if o > pick_o:
                    pick_o = floor = o
                    cmin, cand = c, [i]
                else:
                    cand.append(i)
                    if c < cmin:
                        cmin = c
            if cand:
                if len(cand) > 1:
                    lim = cmin + _EPS
                    cand = [i for i in cand if cost[i] <= lim]
                i = cand[0] if len(cand) == 1 else rng.choice(cand)
                return self._affine(workers[i], pick_o, P, cost[i], best)
        if cfg.turn_tolerance:
            anyreused = ex.get("anyreused")
            if anyreused is None:
                anyreused = ex["anyreused"] = any(r[6] for r in rows)
            if not anyreused:
                limit = best * (1.0 + cfg.turn_tolerance) + cfg.tolerance_blocks + _EPS
                near = [i for i, c in enumerate(cost) if c <= limit]
                if len(near) > 1:
                    oldest = min(rows[i][7] for i in near)
                    turn = [i for i in near if rows[i][7] == oldest]
                    return self._turn(request, workers, turn, len(near), cost, rng, best)
        lim = best + _EPS
        mins = [i for i, c in enumerate(cost) if c <= lim]
        return self._cheapest(request, workers, mins, rng, best)

    def _affine(self, w: WorkerView, o: float, P: int, c: float, best: float) -> Decision:
        return Decision(w.name, w.url, self.name,
                        ("overlap={}/{} blocks, cost={:.1f} (min {:.1f})", int(o), P, float(c), best))

    def _turn(self, request: RouteRequest, workers: Sequence[WorkerView], turn: list[int], near: int,
              cost: Any, rng: random.Random, best: float) -> Decision:
        i = turn[0] if len(turn) == 1 else rng.choice(turn)
        w = workers[i]
        P = request.prompt_blocks
        o = _overlap_of(request, w.name)
        return Decision(w.name, w.url, self.name,
                        ("overlap={}/{} blocks, cost={:.1f} (min {:.1f}): its turn of {} near the minimum"
                         " (no reused prefixes)", o, P, float(cost[i]), best, near))

    def _cheapest(self, request: RouteRequest, workers: Sequence[WorkerView], mins: list[int],
                  rng: random.Random, best: float) -> Decision:
        i = mins[0] if len(mins) == 1 else rng.choice(mins)
        w = workers[i]
        P = request.prompt_blocks
        o = _overlap_of(request, w.name)
        return Decision(w.name, w.url, self.name,
                        ("overlap={}/{} blocks, cost={:.1f} = min of {}{}", o, P, best, len(workers),
                         f" ({len(mins)} tied)" if len(mins) > 1 else ""))

    def _score(self, request: RouteRequest, rows: list[Row], names: Sequence[str],
               scale: list[float] | None) -> tuple[list[float], list[int] | None]:
        """(cost per position, inf for down ones; overlap per position, None when the request
        overlaps no worker)."""
        cfg = self.config
        P = request.prompt_blocks
        ow = cfg.kv_overflow_weight
        ew = cfg.eviction_weight
        lw = cfg.live_weight / P if P else 0.0
        out: list[float] = []
        append = out.append
        ov = request.overlap
        ovs = list(map(ov.get, names, repeat(0))) if ov else None
        min_o = max(1, cfg.min_overlap_blocks)
        for (b, k, hr, _, room, hot, _, _), o in zip(rows, repeat(0) if ovs is None else ovs):
            new = P if o < min_o else (P - o if o < P else 0)
            c = (k + lw * hot) * new + b
            if new > hr:
                c += ow * (new - hr)
            if new > room:
                c += ew * (new - room)
            append(c)
        if scale is not None:
            out = [c * f for c, f in zip(out, scale)]
        return out, ovs

    def _cost_numpy(self, request: RouteRequest, fleet: FleetView,
                    cols: Columns) -> tuple[np.ndarray, np.ndarray | None]:
        """The cost vector of a large fleet (inf for down workers) and the overlap vector (None when
        the request overlaps no worker) — a dozen vectorised operations whatever the fleet size."""
        cfg = self.config
        P = request.prompt_blocks
        base, slope, headroom, _cap, room, hot, _reused, _last = cols.arrays
        ovmap = request.overlap
        m = len(ovmap) if ovmap else 0
        ex = cols.extra
        if cfg.live_weight and P:
            anyhot = ex.get("anyhot")
            if anyhot is None:
                anyhot = ex["anyhot"] = bool(hot.any())
            if anyhot:
                eff = hot * (cfg.live_weight / P)
                eff += slope
                slope = eff
        if m:
            n = len(base)
            if 2 * m >= n:  # most workers overlap: look each worker up (one C-level pass)
                o = np.fromiter(map(ovmap.get, fleet.names, repeat(0)), np.int64, n)
            else:  # a few do: scatter by position; slot n takes names no longer in the fleet (-1)
                o = np.zeros(n + 1, np.int64)
                o[np.fromiter(map(fleet.position_or_minus_one, ovmap), np.intp, m)] = np.fromiter(
                    ovmap.values(), np.int64, m)
                o = o[:n]
            np.minimum(o, P, out=o)
            min_o = max(1, cfg.min_overlap_blocks)
            if min_o > 1:
                o[o < min_o] = 0
            new: Any = P - o
            cost = slope * new
        else:
            o, new = None, P
            cost = slope * P
        cost += base
        hmin = ex.get("hmin")
        if hmin is None or P > hmin:  # (re)compute the exact minimum before paying for the term
            hmin = ex["hmin"] = float(headroom.min())
        if P > hmin:
            t = new - headroom
            np.maximum(t, 0.0, out=t)
            t *= cfg.kv_overflow_weight
            cost += t
        rmin = ex.get("rmin")
        if rmin is None or P > rmin:
            rmin = ex["rmin"] = float(room.min())
        if P > rmin:  # room ≥ 0, so max(0, new − room) ≤ new: the eviction term needs no min
            t = new - room
            np.maximum(t, 0.0, out=t)
            t *= cfg.eviction_weight
            cost += t
        scale = ex.get("scale", False)
        if scale is False:
            scale = ex["scale"] = self._scales_numpy(cols)
        if scale is not None:
            cost *= scale
        return cost, o

    def _choose_numpy(self, request: RouteRequest, fleet: FleetView, cols: Columns,
                      rng: random.Random) -> Decision:
        cfg = self.config
        cost, o = self._cost_numpy(request, fleet, cols)
        best = float(cost[cost.argmin()])  # argmin + index: a third of min()'s reduction overhead
        if best == _INF:
            _raise_none(fleet)
        if o is not None:
            limit = best * (1.0 + cfg.tolerance) + cfg.tolerance_blocks + _EPS
            near = np.where(cost <= limit, o, 0)
            omax = int(near[near.argmax()])
            if omax >= max(1, cfg.min_overlap_blocks):
                cand = np.flatnonzero(near == omax)
                if len(cand) > 1:
                    cc = cost[cand]
                    cand = cand[cc <= cc[cc.argmin()] + _EPS]
                i = int(cand[0]) if len(cand) == 1 else rng.choice(cand.tolist())
                return self._affine(fleet[i], omax, request.prompt_blocks, cost[i], best)
        if cfg.turn_tolerance:
            ex = cols.extra
            anyreused = ex.get("anyreused")
            if anyreused is None:
                anyreused = ex["anyreused"] = bool(cols.arrays[6].any())
            if not anyreused:
                limit = best * (1.0 + cfg.turn_tolerance) + cfg.tolerance_blocks + _EPS
                near = cost <= limit
                n_near = int(np.count_nonzero(near))
                if n_near > 1:
                    last = np.where(near, cols.arrays[7], _INF)
                    turn = np.flatnonzero(last == last[last.argmin()]).tolist()
                    return self._turn(request, fleet, turn, n_near, cost, rng, best)
        return self._cheapest(request, fleet, np.flatnonzero(cost <= best + _EPS).tolist(), rng, best)

    def _scales_numpy(self, cols: Columns) -> np.ndarray | None:
        """`_scales` over cached columns, vectorised (recomputed after a capacity changes)."""
        if not self.config.normalize_by_capacity:
            return None
        base, cap = cols.arrays[0], cols.arrays[3]
        known = cap[(cap > 0) & (base != _INF)]
        if not len(known) or known.min() == known.max():
            return None
        return np.where(cap > 0, known.mean() / np.where(cap > 0, cap, 1.0), 1.0)

    def _scales(self, rows: list[Row]) -> list[float] | None:
        """Per-worker factor mean_cap / cap_w (1 for unknown capacity), or None when all are 1."""
        if not self.config.normalize_by_capacity:
            return None
        known = [r[3] for r in rows if r[3] > 0 and r[0] != _INF]
        if not known or min(known) == max(known):
            return None
        mean = sum(known) / len(known)
        return [mean / r[3] if r[3] > 0 else 1.0 for r in rows]
