"""The router's in-flight ledger: what it dispatched to each worker that the worker's reports can't show yet.

Worker metrics arrive late (SGLang reports per prefill batch and every 40 decode steps) and stop
when a worker goes idle, so between two reports every router would herd onto the same "least
loaded" worker. The ledger counts each dispatch from `on_routed` until `on_finished`/`on_failed`.
A report produced at time T absorbs the dispatches routed before T − `report_latency_s` (they are
now in its `running`/`waiting`/`kv_active` figures); the rest stays *pending* and is added on top of
the report. For an `idle` worker the report is not load at all, so every in-flight request counts.

Per request, in blocks of the router's block size:
- prefill blocks = prompt blocks − cached blocks, counted until the first token (`on_first_token`)
  whether or not a report absorbed the request: a report shows a request in prefill as a slot and
  its KV, never as the work left, so a worker that just started a long prefill must not look free
  (the report's `waiting` is reduced by those requests instead, not to count them twice);
- KV blocks = the same new blocks, counted until the request ends (the engine holds them).

Requests end between reports too: SGLang reports every 40 decode steps, so a short request can
start and finish between two reports, and the last report keeps counting it as running (and its
KV as active) until the next one — or, when that was the worker's last activity, until
`idle_after_s`. So a request that a report absorbed and that finished after that report was
produced is taken back out of the report's figures (`finished`) until a newer report arrives.

The view also dates the replica's last dispatch to each worker (`last_routed_at`), which kv_aware
uses to let workers take turns when nothing is shared.

Router replicas share their pending counts so they don't herd on each other either: `export` is
what this replica publishes; the others' counts arrive in the fleet snapshot per worker
(`set_remote`, re-dated by `refresh_remote`) or per replica (`merge_remote`) into one store, and a
replica not re-dated for `remote_ttl_s` is dropped. Every event is O(1) amortised; the ledger is for one asyncio loop (not thread-safe).
All times are on the ledger's clock (`time.monotonic` by default).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple

from serve_app.policies.base import WorkerView
from serve_app.policies.fleet import FleetView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    """Every number of the ledger, with its reason."""

    report_latency_s: float = 0.1
    """A report produced at T shows only dispatches routed before T − this (HTTP transit,
    tokenization and the scheduler's next iteration come first). Larger is safer: a dispatch
    counted twice for a moment only makes its worker look busier."""
    remote_ttl_s: float = 2.0
    """Another replica's counts are dropped when not refreshed for this long (it died)."""
    max_request_age_s: float = 3600.0
    """A request not finished after this long is forgotten (a lost `on_finished` must not leave a
    worker looking busy forever)."""
    followup_window_s: float = 1.0
    """Requests that finished on a worker within this window count as `recent_finished`: a
    conversation between turns (or a client between calls) is about to send its next request
    there, and it would wait behind whatever cold prefill is put there now."""


class LedgerView(NamedTuple):
    """What the ledger adds to one worker's report (blocks in router blocks)."""

    in_flight: int  # this replica's in-flight requests, all of them
    pending: int  # of those, the ones the report can't show (idle: all)
    pending_prefill_blocks: int  # prompt blocks of this replica's requests not yet past first token
    pending_kv_blocks: int  # KV blocks of pending requests
    remote_pending: int  # other replicas' pending requests on this worker
    finished: int = 0  # requests the last report counts that have finished since
    finished_kv_blocks: int = 0  # their KV blocks
    recent_finished: int = 0  # requests finished within followup_window_s (follow-ups expected)
    prefilling_reported: int = 0  # absorbed by the last report, still before first token
    last_routed_at: float = 0.0  # when this replica last routed a request there (0 = never)
    prefilling: int = 0  # this replica's in-flight requests not yet past first token


class _Req:
    __slots__ = ("worker", "routed_at", "prefill", "kv", "prefilled", "absorbed", "done")

    def __init__(self, worker: str, routed_at: float, prefill: int, kv: int) -> None:
        self.worker = worker
        self.routed_at = routed_at
        self.prefill = prefill
        self.kv = kv
        self.prefilled = False
        self.absorbed = False
        self.done = False


class _Worker:
    __slots__ = ("in_flight", "prefill", "prefill_n", "kv", "pending", "pending_kv", "prefilling_reported",
                 "queue", "reported_at", "gone", "gone_n", "gone_kv", "recent", "last_routed")

    def __init__(self) -> None:
        self.in_flight = 0
        self.prefill = 0  # all in-flight, not yet prefilled
        self.prefill_n = 0  # how many requests that is
        self.kv = 0  # all in-flight
        self.pending = 0  # not absorbed by a report
        self.pending_kv = 0
        self.prefilling_reported = 0  # absorbed, not yet prefilled
        self.queue: deque[_Req] = deque()  # not-yet-absorbed requests in routing order
        self.reported_at = float("-inf")
        self.gone: deque[tuple[float, int]] = deque()  # (end time, kv) of absorbed ones that ended
        self.gone_n = 0
        self.gone_kv = 0
        self.recent: deque[float] = deque()  # end times of requests finished lately
        self.last_routed = 0.0  # when a request was last routed here


class Ledger:
    """Per-worker in-flight bookkeeping of one router replica. Call, per request:

    `on_routed` when the worker is chosen (before the upstream call), `on_first_token` when the first
    response byte/token arrives (prefill done), then exactly one of `on_finished` (stream ended,
    any status) or `on_failed` (never reached the worker or broke before finishing). Per worker
    report: `on_report(worker, at)` with the time the report was produced. Unknown or repeated
    request ids are ignored, so calling the end hooks from `finally` blocks is safe.
    """

    def __init__(
        self,
        config: LedgerConfig | None = None,
        *,
        replica_id: str = "local",
        block_tokens: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or LedgerConfig()
        self.block_tokens = block_tokens  # the router's block size (blocks → worker pages)
        self.replica_id = replica_id
        self._clock = clock
        self._reqs: OrderedDict[str, _Req] = OrderedDict()  # routing order, for the age sweep
        self._workers: dict[str, _Worker] = {}
        self._remote: dict[str, tuple[float, dict[str, int]]] = {}
        self._remote_sum: dict[str, int] = {}
        self._dirty: set[str] = set()
        self.forgotten = 0  # requests dropped by the age sweep (a counter for /metrics)
        self._recent_swept_at = float("-inf")

    # -- the moments of a request ------------------------------------------------------------

    def on_routed(
        self, request_id: str, worker: str, prompt_blocks: int, cached_blocks: int = 0
    ) -> None:
        """The request was sent to `worker`; `cached_blocks` of its prompt are believed cached there."""
        now = self._clock()
        if request_id in self._reqs:
            self._end(request_id)  # a retry on another worker reuses the id
        new = max(0, prompt_blocks - max(0, cached_blocks))
        r = _Req(worker, now, new, new)
        self._reqs[request_id] = r
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        w.in_flight += 1
        w.last_routed = now
        w.prefill += new
        w.prefill_n += 1
        w.kv += new
        w.pending += 1
        w.pending_kv += new
        w.queue.append(r)
        self._dirty.add(worker)
        self._sweep(now)

    def on_first_token(self, request_id: str) -> None:
        """Prefill is done: the request's prompt no longer costs prefill work (its KV stays)."""
        r = self._reqs.get(request_id)
        if r is None or r.prefilled:
            return
        r.prefilled = True
        w = self._workers.get(r.worker)
        if w is None:
            return
        w.prefill -= r.prefill
        w.prefill_n -= 1
        if r.absorbed:
            w.prefilling_reported -= 1
        self._dirty.add(r.worker)

    def on_finished(self, request_id: str) -> None:
        """The response ended (completed, cancelled or errored after reaching the worker)."""
        self._end(request_id, finished=True)

    def on_failed(self, request_id: str) -> None:
        """The request never ran to completion on the worker (connect error, reset before the end)."""
        self._end(request_id)

    # -- reports -----------------------------------------------------------------------------

    def on_report(self, worker: str, at: float) -> None:
        """`worker` produced a report at `at` (ledger clock): dispatches routed before
        `at − report_latency_s` are in it now and stop counting as pending. Older reports than the
        last one are ignored."""
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        if at <= w.reported_at:
            return
        w.reported_at = at
        cutoff = at - self.config.report_latency_s
        q = w.queue
        changed = False
        gone = w.gone
        while gone and gone[0][0] < at:  # ended before this report was produced: not in it
            _, kv = gone.popleft()
            w.gone_n -= 1
            w.gone_kv -= kv
            changed = True
        while q and q[0].routed_at <= cutoff:
            r = q.popleft()
            if r.done or r.absorbed:
                continue
            r.absorbed = True
            w.pending -= 1
            if not r.prefilled:
                w.prefilling_reported += 1
            w.pending_kv -= r.kv
            changed = True
        if changed:
            self._dirty.add(worker)

    # -- what policies see -------------------------------------------------------------------

    def view(self, worker: str, *, idle: bool = False) -> LedgerView:
        """The ledger's figures for `worker`; `idle=True` when its report is not load (all count)."""
        remote = self._remote_sum.get(worker, 0)
        w = self._workers.get(worker)
        if w is None:
            return LedgerView(0, 0, 0, 0, remote)
        if idle:
            return LedgerView(w.in_flight, w.in_flight, w.prefill, w.kv, remote, 0, 0, len(w.recent), 0,
                              w.last_routed, w.prefill_n)
        return LedgerView(w.in_flight, w.pending, w.prefill, w.pending_kv, remote,
                          w.gone_n, w.gone_kv, len(w.recent), w.prefilling_reported, w.last_routed,
                          w.prefill_n)

    def in_flight(self, worker: str) -> int:
        w = self._workers.get(worker)
        return w.in_flight if w is not None else 0

    def apply(self, view: WorkerView) -> WorkerView:
        """`view` (reported figures from the snapshot) with the ledger's figures filled in; an
        `idle` worker's reported activity is zeroed and all its in-flight requests count."""
        v = view
        idle = v.state == "idle"
        lv = self.view(v.name, idle=idle)
        if idle:
            return WorkerView(v.name, v.url, v.state, v.page_size, 0, v.total_slots, 0, 0,
                              v.kv_total_blocks, *lv[:5], v.hot_blocks, lv.recent_finished,
                              v.reused_blocks, lv.last_routed_at, lv.prefilling, v.worker, v.rank)
        running, waiting, kv = v.running, v.waiting, v.kv_active_blocks
        if lv.finished:  # ended since the report: out of its running (then waiting) and KV figures
            gone = lv.finished
            if gone > running:
                waiting = max(0, waiting - (gone - running))
            running = max(0, running - gone)
            kv = max(0, kv - -(-lv.finished_kv_blocks * self.block_tokens // max(1, v.page_size)))
        if lv.prefilling_reported:  # their prefill is in pending_prefill_blocks already
            waiting = max(0, waiting - lv.prefilling_reported)
        return WorkerView(v.name, v.url, v.state, v.page_size, running, v.total_slots, waiting,
                          kv, v.kv_total_blocks, *lv[:5], v.hot_blocks, lv.recent_finished,
                          v.reused_blocks, lv.last_routed_at, lv.prefilling, v.worker, v.rank)

    def take_dirty(self) -> set[str]:
        """Workers whose ledger figures changed since the last call (rebuild only their views)."""
        self.expire_remote()
        now = self._clock()
        if now - self._recent_swept_at >= 0.05:  # recent_finished decays with time: O(workers)
            self._recent_swept_at = now
            cutoff = now - self.config.followup_window_s
            for name, w in self._workers.items():
                if _trim(w.recent, cutoff):
                    self._dirty.add(name)
        d, self._dirty = self._dirty, set()
        return d

    def remove_worker(self, worker: str) -> None:
        """Forget a worker that left the fleet; its requests' later end hooks are ignored."""
        w = self._workers.pop(worker, None)
        if w is not None:
            for r in w.queue:
                r.done = True
        for rid in [rid for rid, r in self._reqs.items() if r.worker == worker]:
            self._reqs.pop(rid).done = True
        self._dirty.add(worker)

    # -- sharing across router replicas ------------------------------------------------------

    def export(self) -> dict[str, int]:
        """This replica's pending counts per worker (only non-zero), for the other replicas.

        Pending, not in-flight: the other replicas see the same reports, so only what the reports
        don't show yet is news to them."""
        return {name: w.pending for name, w in self._workers.items() if w.pending}

    def merge_remote(self, replica_id: str, counts: Mapping[str, int], at: float | None = None) -> None:
        """Replace replica `replica_id`'s counts (from its `export`), received at `at` (ledger clock)."""
        if replica_id == self.replica_id:
            return
        at = self._clock() if at is None else at
        old = self._remote.get(replica_id)
        if old is not None:
            if at < old[0]:
                return
            self._sub_remote(old[1])
        fresh = {k: int(v) for k, v in counts.items() if int(v) > 0}
        self._remote[replica_id] = (at, fresh)
        for k, v in fresh.items():
            self._remote_sum[k] = self._remote_sum.get(k, 0) + v
            self._dirty.add(k)
        self.expire_remote()

    def set_remote(self, worker: str, by_replica: Mapping[str, int], at: float | None = None) -> None:
        """Other replicas' pending counts on `worker` as the fleet snapshot shows them (replica →
        count; this replica's own entry is ignored). Replaces what was known for `worker`; the
        replicas whose count changed are dated `at` (ledger clock). The one store of other
        replicas' counts: `merge_remote` writes the same one, a replica at a time."""
        at = self._clock() if at is None else at
        for rid, (when, counts) in list(self._remote.items()):
            old = counts.get(worker, 0)
            new = int(by_replica.get(rid, 0)) if rid != self.replica_id else 0
            if old == new or (new <= 0 and not old):
                continue
            if new > 0:
                counts[worker] = new
            else:
                del counts[worker]
            self._add_remote(worker, new - old if new > 0 else -old)
            self._remote[rid] = (max(when, at), counts)
        for rid, n in by_replica.items():
            n = int(n)
            if n > 0 and rid != self.replica_id and rid not in self._remote:
                self._remote[rid] = (at, {worker: n})
                self._add_remote(worker, n)

    def refresh_remote(self, at: float | None = None) -> None:
        """Re-date every replica whose counts the snapshot still shows (the aggregator expires dead
        replicas; without this, `expire_remote` would drop live ones whose counts did not change)
        and forget those with none left."""
        at = self._clock() if at is None else at
        for rid, (_, counts) in list(self._remote.items()):
            if counts:
                self._remote[rid] = (at, counts)
            else:
                del self._remote[rid]

    def _add_remote(self, worker: str, delta: int) -> None:
        left = self._remote_sum.get(worker, 0) + delta
        if left > 0:
            self._remote_sum[worker] = left
        else:
            self._remote_sum.pop(worker, None)
        self._dirty.add(worker)

    def expire_remote(self, now: float | None = None) -> None:
        """Drop replicas not heard from for `remote_ttl_s` (cheap: replicas are few)."""
        if not self._remote:
            return
        now = self._clock() if now is None else now
        limit = now - self.config.remote_ttl_s
        for rid in [rid for rid, (at, _) in self._remote.items() if at < limit]:
            log.info("router replica %s silent for %.1fs: dropping its in-flight counts",
                     rid, now - self._remote[rid][0])
            self._sub_remote(self._remote.pop(rid)[1])

    def _sub_remote(self, counts: Mapping[str, int]) -> None:
        for k, v in counts.items():
            left = self._remote_sum.get(k, 0) - v
            if left > 0:
                self._remote_sum[k] = left
            else:
                self._remote_sum.pop(k, None)
            self._dirty.add(k)

    # -- internals ---------------------------------------------------------------------------

    def _end(self, request_id: str, finished: bool = False) -> None:
        r = self._reqs.pop(request_id, None)
        if r is None or r.done:
            return
        r.done = True
        w = self._workers.get(r.worker)
        if w is None:
            return
        now = self._clock()
        if finished:
            w.recent.append(now)
            _trim(w.recent, now - self.config.followup_window_s)  # bounded by one window's finishes
        w.in_flight -= 1
        w.kv -= r.kv
        if not r.prefilled:
            w.prefill -= r.prefill
            w.prefill_n -= 1
            if r.absorbed:
                w.prefilling_reported -= 1
        if r.absorbed:  # the last report counts it: take it back out until a newer report
            w.gone.append((now, r.kv))
            w.gone_n += 1
            w.gone_kv += r.kv
        else:
            w.pending -= 1
            w.pending_kv -= r.kv
            # finished entries stay in the queue until a report pops them; compact when they
            # dominate (a worker that never reports must not grow the queue without bound)
            if len(w.queue) > 2 * w.pending + 64:
                w.queue = deque(x for x in w.queue if not x.done)
        self._dirty.add(r.worker)

    def _sweep(self, now: float) -> None:
        limit = now - self.config.max_request_age_s
        reqs = self._reqs
        while reqs:
            rid, r = next(iter(reqs.items()))
            if r.routed_at >= limit:
                return
            log.warning("request %s on worker %s not finished after %.0fs: forgetting it",
                        rid, r.worker, now - r.routed_at)
            self.forgotten += 1
            self._end(rid)


def _trim(times: deque[float], cutoff: float) -> bool:
    """Drop the times older than `cutoff` from the front of an ascending deque; True if any."""
    n = len(times)
    while times and times[0] < cutoff:
        times.popleft()
    return len(times) != n


def apply_all(ledger: Ledger, views: Iterable[WorkerView]) -> list[WorkerView]:
    """Every view with the ledger applied (when a snapshot arrives; see `refresh_fleet` per request)."""
    return [ledger.apply(v) for v in views]


def refresh_fleet(
    fleet: FleetView, base: Mapping[str, WorkerView], ledger: Ledger, also: Iterable[str] = ()
) -> None:
    """Re-apply the ledger to the workers whose figures changed since the last call (and to
    `also`, workers whose `base` view changed otherwise).

    `base` holds each worker's view as the snapshot gave it (no ledger figures). Call before every
    decision; after a new snapshot, build `FleetView(apply_all(ledger, base.values()))` instead."""
    names = ledger.take_dirty()
    if also:
        names |= set(also)
    for name in names:
        v = base.get(name)
        if v is not None:
            fleet.update(ledger.apply(v))
