"""kv_aware: prefix-cache overlap and load in one cost (after NVIDIA Dynamo's KV router).

For each routable worker w, in blocks of B = `request.block_tokens` tokens:

    P        = ceil(prompt_tokens / B)                       blocks of this prompt
    o        = min(overlap[w], P)                            leading blocks w already caches
                                                            (0 if below min_overlap_blocks)
    new      = P − o                                         blocks w must prefill and allocate
    decoding = max(in_flight − prefilling, running)          requests past their first token there
    prefill  = pending_prefill_blocks + remote_request_blocks·remote_pending
               + new·(1 + cobatch_weight·(prefilling + waiting) + stall_weight·decoding)
                                                            every request before its first token there
                                                            waits for this prompt's prefill too, and
                                                            every decoding one pauses for it
    held     = kv_active_blocks·page_size/B + pending_kv_blocks      KV blocks w holds already
    kv       = kv_weight·(held + new)
    queued   = waiting + max(0, running + pending + remote_pending + 1 − total_slots)
                                                            (slot term only when total_slots > 0)
    total    = kv_total_blocks·page_size/B
    over     = max(0, held + new − kv_high_watermark·total)  (only when kv_total_blocks > 0)
    room     = min(total − held, kv_high_watermark·total − hot_blocks)
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
itself. Pricing only its own wait stacks consecutive cold prompts into one batch on real traffic:
with perfect information, a greedy pick's median first token on the Mooncake replay is 221 ms, one
that prices the sum 175 ms (`bench/results/routesim-mooncake.md`). The weights are such that the
prompt-independent terms (KV held, hot set) do not drown the prefill queued ahead: on that traffic
the median request waits longer for the prompts in its batch than for its own prefill.
`decoding` prices the same delay for the requests already streaming there (`stall_weight`, off by
default): SGLang runs a prefill batch instead of a decode step when prompts wait
(`enable_mixed_chunk` is off by default), so every request decoding on w pauses for this prompt's
whole prefill — its end-to-end time grows by it, though no first token does. On the Mooncake replay
the pauses are most of a reply's decode time after its own tokens, for every router (~64 µs per
prefill token that lands on its worker while it streams; `bench.dump_phases`); pricing them trades
first-token tails for end-to-end ones (the field's evidence). `running` is the report's (other
replicas' requests too), `in_flight − prefilling` this replica's own, current ones.
`recent_finished` counts requests that finished on w within the ledger's follow-up window (an
older, noisier estimate of the same thing; `followup_weight` is 0 by default).

In code, the terms that do not depend on the prompt are computed once per worker view
(`WorkerTerms`: base, per_new_block, kv_headroom, evict_room, …) and kept as named numpy columns on
the router's fleet view (`FleetTerms`), so a decision is a dozen vectorised operations over the
fleet whatever its size; overlap arrives as tiers of holder sets (`serve_app.policies.overlap`).

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
from itertools import repeat
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from serve_app.policies.base import Decision, decision, RouteRequest, WorkerView, _raise_none
from serve_app.policies.fleet import FleetView
from serve_app.policies.overlap import Overlap

_EPS = 1e-9
_INF = float("inf")


class KvAwareConfig(BaseModel):
    """Every knob of kv_aware (`router.kv_aware` in the config); costs are in prompt blocks of the
    router's block size. Unknown keys are errors; the model is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    prefill_weight: float = Field(
        4.0, ge=0, description="weight of blocks still to prefill against KV blocks held "
        "(Dynamo's prefill_load_scale)")
    queued_request_blocks: float = Field(
        128.0, ge=0, description="cost of one request queued ahead: each reported waiting request and "
        "each one beyond the worker's slots (it waits for a running request to finish)")
    remote_request_blocks: float = Field(
        32.0, ge=0, description="assumed prefill blocks of a request another router replica dispatched "
        "(its size is unknown here)")
    kv_high_watermark: float = Field(
        0.9, gt=0, le=1, description="fraction of KV capacity above which every further block costs "
        "kv_overflow_weight more; the hot set must leave the rest to the running requests")
    kv_overflow_weight: float = Field(
        4.0, ge=0, description="extra cost per block over the watermark (the engine would queue, evict "
        "or retract)")
    # evidence (with live_weight 1, kv_weight 0.25): virtual-time Mooncake replay TTFT p50 / p99 at
    # 16 / 20 / 24 req/s 228 / 938, 254 / 1,048, 286 / 1,197 → 205 / 928, 224 / 996, 259 / 1,115 ms
    # (2 seeds), 36 req/s 30.6 → 31.8 req/s; designed workloads unchanged at the suites' rates
    # (bench/results/routesim-mooncake.md, 2026-12-04)
    tolerance: float = Field(
        0.25, ge=0, description="relative slack of the near-minimum set: workers within "
        "c*·(1 + tolerance) + tolerance_blocks count as near the cheapest, and the affine one among "
        "them wins")
    tolerance_blocks: float = Field(8.0, ge=0, description="absolute slack of the near-minimum set, in blocks")
    min_overlap_blocks: int = Field(
        1, ge=0, description="overlap below this many blocks is not affinity (and saves no prefill)")
    normalize_by_capacity: bool = Field(
        True, description="scale each cost by mean KV capacity / the worker's, so a 2× larger worker "
        "takes 2× the load")
    eviction_weight: float = Field(
        5.0, ge=0, description="cost per hot cached block a prompt would evict: it is prefilled again "
        "when its prefix comes back (the default is one prefill: prefill_weight + 1 for its KV)")
    # 1 (was 4): on real traffic (single-turn Mooncake prompts) the hot set is mostly prompts sent once,
    # not live sessions, and at 4 its differences between workers (thousands of blocks) outweighed the
    # prefill queued ahead, so a burst of cold prompts went into one worker's prefill batch
    live_weight: float = Field(
        1.0, ge=0, description="cost per hot block of the worker times this prompt's cold share "
        "(new / P): each live session there waits behind the new prefill")
    # evidence: virtual-time Mooncake replay at 16 / 20 / 24 req/s, TTFT p50 266 → 236, 282 → 249,
    # 311 → 299 ms; p99 969 → 891, 996 → 1,112, 1,126 → 1,234, still below round-robin's
    # 966 / 1,205 / 1,648; designed workloads unchanged (bench/results/mooncake.md)
    cobatch_weight: float = Field(
        1.0, ge=0, description="the delay a prompt adds to the requests it is prefilled with: each "
        "request on the worker still before its first token (this router's, plus the reported waiting "
        "ones) waits for its new blocks too, so each new block costs "
        "prefill_weight·(1 + cobatch_weight·those requests); 0 prices only the prompt's own wait")
    # 0 (off): in virtual time (`bench.routesim --suite standard --workload mooncake --seeds 2 --kv
    # stall_weight=W`) 0.25 / 0.5 / 1 moved the Mooncake replay at 20 req/s E2E p50 857 → 848 / 845 /
    # 824 ms and p99 3,386 → 3,305 / 3,354 / 3,279 but TTFT p50 160 → 163 / 168 / 172 and p99
    # 887 → 918 / 906 / 1,035; at 4 and 10 req/s mixed (bench/results/dynamo.md): a trade, not a win
    stall_weight: float = Field(
        0.0, ge=0, description="the pause a prompt causes the requests decoding on the worker: SGLang "
        "runs its prefill instead of their decode steps, so each new block costs "
        "prefill_weight·stall_weight more per decoding request (max(in_flight − prefilling, running)); "
        "0 prices only first-token delays")
    # 1.0 (0.25 since 2026-12-04, 1 before): KV held by decoding requests delays no first token until
    # the pool is near full, but every decode step there reads it — the decode load Dynamo's cost
    # counts block for block with the prefill. Against Dynamo 1.6.1 on the same events (issue 34) the
    # end-to-end tail was kvroute's open goal; in virtual time 0.25 → 1.0 moved the Mooncake replay's
    # E2E p99 3,590 → 3,386 ms, TTFT p99 915 → 887, TTFT p50 155 → 160; multi-turn E2E p99
    # 1,972 → 1,802; shared prefix and no sharing unchanged (2 seeds, bench/results/dynamo.md)
    kv_weight: float = Field(
        1.0, ge=0, description="cost per KV block held (the report's kv_active_blocks plus this "
        "router's pending ones) and per new block this prompt allocates")
    # evidence: live_weight is steadier (virtual-time multi-turn TTFT p50 79 → 27 ms at 16 req/s,
    # bench/results/routesim.md)
    followup_weight: float = Field(
        0.0, ge=0, description="cost per new block per request that finished on the worker within the "
        "ledger's follow-up window (follow-ups that would wait behind it); off by default, "
        "live_weight estimates the same from the hot set")
    # evidence: virtual-time no-sharing TTFT p99 equal to round-robin's at 8–24 req/s, was up to
    # 1.2× (bench/results/routesim.md)
    turn_tolerance: float = Field(
        0.25, ge=0, description="when no routable worker holds reused prefixes and no affine worker "
        "wins, workers take turns: of those within c*·(1 + turn_tolerance) + tolerance_blocks, the one "
        "this router sent a request to longest ago; 0 disables it")


class WorkerTerms(NamedTuple):
    """The request-independent part of one worker's cost (module docstring), in prompt blocks:

        cost(new) = scale · (base + (per_new_block + live_weight·hot / P)·new
                             + kv_overflow_weight·max(0, new − kv_headroom)
                             + eviction_weight·max(0, new − evict_room))
    """

    base: float  # prefill_weight·(pending_prefill_blocks + remote_request_blocks·remote_pending)
    # + kv_weight·kv_held + queued_request_blocks·queued; inf when the worker is down
    per_new_block: float  # prefill_weight·(1 + cobatch_weight·(prefilling + waiting) + stall_weight·decoding)
    # + kv_weight
    # + followup_weight·recent_finished
    kv_headroom: float  # kv_high_watermark·total − kv_held (inf: capacity unknown)
    evict_room: float  # room, ≥ 0 (inf: capacity unknown)
    capacity: float  # kv_total_blocks·page_size tokens (0: unknown)
    hot: float  # hot_blocks
    reused: float  # reused_blocks (0 when down: nothing there to protect)
    last_routed_at: float


def worker_terms(cfg: KvAwareConfig, w: WorkerView, block_tokens: int) -> WorkerTerms:
    """`WorkerTerms` of `w` under `cfg`, for prompts hashed in blocks of `block_tokens` tokens."""
    per_page = w.page_size / block_tokens
    kv_held = w.kv_active_blocks * per_page + w.pending_kv_blocks
    queued = w.waiting
    if w.total_slots:
        beyond_slots = w.running + w.pending + w.remote_pending + 1 - w.total_slots
        if beyond_slots > 0:
            queued += beyond_slots
    base = cfg.prefill_weight * (w.pending_prefill_blocks + cfg.remote_request_blocks * w.remote_pending) \
        + cfg.kv_weight * kv_held + cfg.queued_request_blocks * queued
    if w.kv_total_blocks:
        total = w.kv_total_blocks * per_page
        headroom = cfg.kv_high_watermark * total - kv_held
        room = max(0.0, min(total - kv_held, cfg.kv_high_watermark * total - w.hot_blocks))
        capacity = float(w.kv_total_blocks * w.page_size)
    else:
        headroom, room, capacity = _INF, _INF, 0.0
    down = w.state == "down"
    decoding = max(w.in_flight - w.prefilling, w.running)
    per_new_block = cfg.prefill_weight * (1.0 + cfg.cobatch_weight * (w.prefilling + w.waiting)
                                          + cfg.stall_weight * decoding) \
        + cfg.kv_weight + cfg.followup_weight * w.recent_finished
    return WorkerTerms(_INF if down else base, per_new_block, headroom, room, capacity,
                       float(w.hot_blocks), 0.0 if down else float(w.reused_blocks), w.last_routed_at)


class FleetTerms:
    """Every worker's `WorkerTerms` as named numpy columns (`terms.base[i]`, …), kept current one
    worker at a time by `FleetView.update`, plus the fleet-wide figures the cost needs: the capacity
    `scale`, and bounds that let it skip a term that is zero for every worker."""

    __slots__ = (*WorkerTerms._fields, "_terms_of", "_normalize", "_scale", "_min_headroom", "_min_room",
                 "_any_hot", "_any_reused")
    base: np.ndarray
    per_new_block: np.ndarray
    kv_headroom: np.ndarray
    evict_room: np.ndarray
    capacity: np.ndarray
    hot: np.ndarray
    reused: np.ndarray
    last_routed_at: np.ndarray

    def __init__(self, views: Sequence[WorkerView], terms_of: Callable[[WorkerView], WorkerTerms],
                 normalize: bool) -> None:
        rows = np.array([terms_of(v) for v in views], np.float64).reshape(len(views), len(WorkerTerms._fields))
        for k, name in enumerate(WorkerTerms._fields):
            setattr(self, name, np.ascontiguousarray(rows[:, k]))
        self._terms_of = terms_of
        self._normalize = normalize
        self._scale: np.ndarray | None | bool = False  # False: not computed yet
        self._min_headroom: float | None = None  # lower bounds, made exact when they matter
        self._min_room: float | None = None
        self._any_hot: bool | None = None  # True may be stale (harmless: the term adds zeros)
        self._any_reused: bool | None = None  # exact (None: count again)

    def set(self, i: int, view: WorkerView) -> None:
        t = self._terms_of(view)
        if t.capacity != self.capacity[i] or (t.base == _INF) != (self.base[i] == _INF):
            self._scale = False
        if self._min_headroom is not None and t.kv_headroom < self._min_headroom:
            self._min_headroom = t.kv_headroom
        if self._min_room is not None and t.evict_room < self._min_room:
            self._min_room = t.evict_room
        if t.hot and self._any_hot is False:
            self._any_hot = True
        if t.reused:
            if self._any_reused is False:
                self._any_reused = True
        elif self.reused[i]:
            self._any_reused = None  # maybe the last worker with reused prefixes
        self.base[i], self.per_new_block[i], self.kv_headroom[i], self.evict_room[i], self.capacity[i], \
            self.hot[i], self.reused[i], self.last_routed_at[i] = t

    def scale(self) -> np.ndarray | None:
        """Per worker mean_capacity / capacity_w over the routable workers that report one (1 for
        unknown capacity), or None when every factor is 1 (or normalize_by_capacity is off)."""
        s = self._scale
        if s is False:
            s = self._scale = None
            if self._normalize:
                cap = self.capacity
                known = cap[(cap > 0) & (self.base != _INF)].tolist()
                if known and min(known) != max(known):
                    mean = sum(known) / len(known)
                    s = self._scale = np.where(cap > 0, mean / np.where(cap > 0, cap, 1.0), 1.0)
        return s  # type: ignore[return-value]

    def may_pass_headroom(self, blocks: float) -> bool:
        """Whether `blocks` new blocks take any worker over its KV watermark."""
        h = self._min_headroom
        if h is None or blocks > h:
            h = self._min_headroom = float(self.kv_headroom.min())
        return blocks > h

    def may_evict(self, blocks: float) -> bool:
        """Whether `blocks` new blocks evict hot blocks on any worker."""
        r = self._min_room
        if r is None or blocks > r:
            r = self._min_room = float(self.evict_room.min())
        return blocks > r

    def any_hot(self) -> bool:
        if self._any_hot is None:
            self._any_hot = bool(self.hot.any())
        return self._any_hot

    def any_reused(self) -> bool:
        if self._any_reused is None:
            self._any_reused = bool(self.reused.any())
        return self._any_reused


class KvAware:
    """The cost and the choice of the module docstring, evaluated over the whole fleet at once
    (the request-independent terms cached on the router's `FleetView` across requests)."""

    name = "kv_aware"

    def __init__(self, config: KvAwareConfig | None = None) -> None:
        self.config = config or KvAwareConfig()
        self._builders: dict[int, Callable[[list[WorkerView]], FleetTerms]] = {}

    def terms(self, fleet: FleetView, block_tokens: int) -> FleetTerms:
        """The fleet's `FleetTerms` for prompts in blocks of `block_tokens` (cached on `fleet`)."""
        build = self._builders.get(block_tokens)
        if build is None:
            cfg = self.config

            def terms_of(w: WorkerView) -> WorkerTerms:
                return worker_terms(cfg, w, block_tokens)

            def build(views: list[WorkerView]) -> FleetTerms:
                return FleetTerms(views, terms_of, cfg.normalize_by_capacity)

            self._builders[block_tokens] = build
        return fleet.derived((self, block_tokens), build)

    def costs(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, float]:
        """Cost per routable worker (for inspection, tests and `/route` debugging)."""
        fleet = workers if isinstance(workers, FleetView) else FleetView(workers)
        if not len(fleet):
            return {}
        cost, _ = self._fleet_cost(request, fleet)
        return {name: c for name, c in zip(fleet.names, cost.tolist()) if c != _INF}

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random) -> Decision:
        cfg = self.config
        fleet = workers if isinstance(workers, FleetView) else FleetView(workers)
        if not len(fleet):
            _raise_none(fleet)
        cost, o = self._fleet_cost(request, fleet)
        best = float(cost[cost.argmin()])  # argmin + index: a third of min()'s reduction overhead
        if best == _INF:
            _raise_none(fleet)
        P = request.prompt_blocks
        if o is not None:
            # the affine worker among the near-minimum ones: most overlap, then cheapest, then random
            near = np.where(cost <= best * (1.0 + cfg.tolerance) + cfg.tolerance_blocks + _EPS, o, 0)
            most = int(near[near.argmax()])
            if most >= max(1, cfg.min_overlap_blocks):
                cand = np.flatnonzero(near == most)
                if len(cand) > 1:
                    cc = cost[cand]
                    cand = cand[cc <= cc[cc.argmin()] + _EPS]
                i = int(cand[0]) if len(cand) == 1 else rng.choice(cand.tolist())
                return decision(fleet[i], self.name,
                                ("overlap={}/{} blocks, cost={:.1f} (min {:.1f})", most, P, float(cost[i]), best))
        if cfg.turn_tolerance and not self.terms(fleet, request.block_tokens).any_reused():
            near_mask = cost <= best * (1.0 + cfg.turn_tolerance) + cfg.tolerance_blocks + _EPS
            n_near = int(np.count_nonzero(near_mask))
            if n_near > 1:
                last = np.where(near_mask, self.terms(fleet, request.block_tokens).last_routed_at, _INF)
                turn = np.flatnonzero(last == last[last.argmin()]).tolist()
                i = turn[0] if len(turn) == 1 else rng.choice(turn)
                w = fleet[i]
                return decision(w, self.name,
                                ("overlap={}/{} blocks, cost={:.1f} (min {:.1f}): its turn of {} near the minimum"
                                 " (no reused prefixes)", _overlap_of(request, w.name), P, float(cost[i]), best,
                                 n_near))
        mins = np.flatnonzero(cost <= best + _EPS).tolist()
        i = mins[0] if len(mins) == 1 else rng.choice(mins)
        w = fleet[i]
        return decision(w, self.name,
                        ("overlap={}/{} blocks, cost={:.1f} = min of {}{}", _overlap_of(request, w.name), P, best,
                         len(fleet), f" ({len(mins)} tied)" if len(mins) > 1 else ""))

    def _fleet_cost(self, request: RouteRequest, fleet: FleetView) -> tuple[np.ndarray, np.ndarray | None]:
        """The cost of every worker (inf for down ones) and its overlap in blocks (None when the
        request overlaps no worker): the module docstring's formula over `FleetTerms`' columns."""
        cfg = self.config
        t = self.terms(fleet, request.block_tokens)
        P = request.prompt_blocks
        o = self._overlap_blocks(request, fleet, P)
        new: Any = P if o is None else P - o
        per_new_block = t.per_new_block
        if cfg.live_weight and P and t.any_hot():
            per_new_block = t.hot * (cfg.live_weight / P) + per_new_block
        cost = per_new_block * new + t.base
        if t.may_pass_headroom(P):
            cost += cfg.kv_overflow_weight * np.maximum(new - t.kv_headroom, 0.0)
        if t.may_evict(P):  # evict_room ≥ 0, so max(0, new − room) ≤ new: no min(new, ·) needed
            cost += cfg.eviction_weight * np.maximum(new - t.evict_room, 0.0)
        scale = t.scale()
        if scale is not None:
            cost *= scale
        return cost, o

    def _overlap_blocks(self, request: RouteRequest, fleet: FleetView, P: int) -> np.ndarray | None:
        """o = min(overlap, P) per worker in fleet order (0 below min_overlap_blocks), or None."""
        ov = request.overlap
        if not ov:
            return None
        n = len(fleet)
        if isinstance(ov, Overlap):  # tiers of holder sets: a scatter per tier, whatever their size
            ids = [(blocks, holders.ids()) for blocks, holders in ov.tiers]
            pos = fleet.positions_by_id()
            o = np.zeros(n + 1, np.int64)  # slot n: workers outside this fleet
            for blocks, h in ids:
                o[pos[h]] = blocks
            for name, v in ov.fixed.items():
                i = fleet.position(name)
                if i is not None:
                    o[i] = v
            o = o[:n]
        elif 2 * len(ov) >= n:  # a plain mapping naming most workers: look each one up
            o = np.fromiter(map(ov.get, fleet.names, repeat(0)), np.int64, n)
        else:  # naming a few: scatter by position (slot n takes names outside this fleet)
            o = np.zeros(n + 1, np.int64)
            o[np.fromiter(map(fleet.position_or_minus_one, ov), np.intp, len(ov))] = np.fromiter(
                ov.values(), np.int64, len(ov))
            o = o[:n]
        np.minimum(o, P, out=o)
        if self.config.min_overlap_blocks > 1:
            o[o < self.config.min_overlap_blocks] = 0
        return o


def _overlap_of(request: RouteRequest, worker: str) -> int:
    """Leading blocks of the prompt `worker` is believed to hold (for a decision's reason)."""
    return min(request.overlap.get(worker, 0), request.prompt_blocks) if request.overlap else 0
