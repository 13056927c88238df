"""kvroute's figures through `ray.util.metrics`: they reach the Ray cluster's Prometheus (and Ray's
Grafana) with no new scrape target. The router's own `/metrics` (`serve_app.metrics`) stays for
kvroute's HTTP front door; the names here are the same figures, listed once in `METRICS`.

Ray's metrics agent exports every application metric with a `ray_` prefix; counters carry a
`_total` suffix and histograms `_bucket`/`_sum`/`_count` — `prometheus_names()` spells that out for
dashboards (`deploy/grafana/kvroute-ray.json`, checked against it by a test).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from actors.worker.ingest import MetricsBook
    from serve_app.router import RouterCore

logger = logging.getLogger("kvroute.ray_llm.metrics")

_STATES = ("live", "idle", "down")
LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
DECISION_BOUNDARIES_S = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2]

# name → (kind, description, tag keys); the one list of what kvroute exports through Ray
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kvroute_router_decisions": ("counter", "Routing decisions of kvroute's Serve request router, by policy and "
                                 "reason (prefix: the pick holds part of the prompt; load; no_metrics, "
                                 "aggregator_stale, no_prompt, no_worker: load-balanced by Serve)",
                                 ("deployment", "policy", "reason")),
    "kvroute_router_first_tokens": ("counter", "First tokens the ingress signalled for requests this router routed "
                                    "(their prefill charge released)", ("deployment",)),
    "kvroute_router_decision_seconds": ("histogram", "Time choose_replicas spent deciding, per request",
                                        ("deployment",)),
    "kvroute_worker_in_flight_requests": ("gauge", "Requests this router sent to the replica and not finished",
                                          ("deployment", "worker")),
    "kvroute_worker_state": ("gauge", "1 for the replica's current state (live, idle, down)",
                             ("deployment", "worker", "state")),
    "kvroute_worker_running_requests": ("gauge", "Reported running requests", ("deployment", "worker")),
    "kvroute_worker_waiting_requests": ("gauge", "Reported queued requests", ("deployment", "worker")),
    "kvroute_worker_kv_usage_ratio": ("gauge", "Reported KV cache use (0..1)", ("deployment", "worker")),
    # an attention-DP replica's ranks (the per-worker series above sum them, KV use token-weighted); SGLang's
    # in-engine DP controller picks the rank, so there is no per-rank in-flight series here
    "kvroute_worker_rank_running_requests": ("gauge", "Reported running requests of one attention-DP rank "
                                             "(replicas with dp_size > 1 only)", ("deployment", "worker", "rank")),
    "kvroute_worker_rank_waiting_requests": ("gauge", "Reported queued requests of one attention-DP rank "
                                             "(replicas with dp_size > 1 only)", ("deployment", "worker", "rank")),
    "kvroute_worker_rank_kv_usage_ratio": ("gauge", "Reported KV cache use (0..1) of one attention-DP rank "
                                           "(replicas with dp_size > 1 only)", ("deployment", "worker", "rank")),
    "kvroute_worker_metrics_age_seconds": ("gauge", "Age of the replica's newest KvMetrics (-1: none yet)",
                                           ("deployment", "worker")),
    "kvroute_worker_exact_blocks": ("gauge", "Blocks of the replica's prefix cache in this router's exact index "
                                    "(exact prefix mode: from its engine's KV events; -1: its KV log not followed)",
                                    ("deployment", "worker")),
    "kvroute_snapshot_age_seconds": ("gauge", "Time since the aggregator last answered this router",
                                     ("deployment",)),
    "kvroute_aggregator_reachable": ("gauge", "1 if this router's snapshot stream is connected", ("deployment",)),
    "kvroute_replica_frames": ("counter", "KvMetrics frames the replica's collector received, by outcome "
                               "(accepted, or the refusal reason)", ("worker", "outcome")),
    "kvroute_replica_ttft_seconds": ("histogram", "Time to first streamed chunk, measured in the replica",
                                     ("worker",)),
}


def prometheus_names() -> set[str]:
    """Every series name `METRICS` produces in Prometheus through Ray's metrics agent."""
    out: set[str] = set()
    for name, (kind, _, _) in METRICS.items():
        base = f"ray_{name}"
        if kind == "counter":
            out.add(f"{base}_total")
        elif kind == "histogram":
            out |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        else:
            out.add(base)
    return out


def _make(name: str) -> Any:
    from ray.util import metrics

    kind, desc, tags = METRICS[name]
    if kind == "counter":
        return metrics.Counter(name, description=desc, tag_keys=tags)
    if kind == "histogram":
        bounds = DECISION_BOUNDARIES_S if name == "kvroute_router_decision_seconds" else LATENCY_BOUNDARIES_S
        return metrics.Histogram(name, description=desc, boundaries=bounds, tag_keys=tags)
    return metrics.Gauge(name, description=desc, tag_keys=tags)


class RouterExporter:
    """The request router's figures: decisions as they happen, the fleet as gauges every `period_s`.

    Ray's gauges keep a tag set's last value for as long as the exporting process lives (there is no
    way to drop one), and the router lives as long as its ingress replica — while the replicas it
    routes come and go. So a worker that leaves the fleet gets its gauges zeroed once (no state is 1,
    metrics age and exact blocks -1): the dashboard keeps only workers with a state of 1, and a
    replaced replica no longer shows as `live` (or `down`) beside its replacement for ever."""

    def __init__(self, core: "RouterCore", deployment: str, period_s: float = 1.0,
                 make: Callable[[str], Any] | None = None) -> None:
        self.core = core
        self.deployment = deployment
        self.period_s = period_s
        make = make or _make
        self._m = {n: make(n) for n in METRICS if n.startswith(("kvroute_router", "kvroute_worker", "kvroute_snap",
                                                                "kvroute_aggregator"))}
        self._task: asyncio.Task | None = None
        self._shown: dict[str, set[str]] = {}  # worker → rank labels exported (none: one rank), until it leaves

    def on_decision(self, policy: str, reason: str, seconds: float) -> None:
        tags = {"deployment": self.deployment}
        self._m["kvroute_router_decisions"].inc(1, tags={**tags, "policy": policy, "reason": reason})
        self._m["kvroute_router_decision_seconds"].observe(seconds, tags=tags)

    def on_first_token(self) -> None:
        self._m["kvroute_router_first_tokens"].inc(1, tags={"deployment": self.deployment})

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.export_fleet()
            except Exception:  # a metrics bug must never touch routing
                logger.exception("kvroute metrics export failed")
            await asyncio.sleep(self.period_s)

    def export_fleet(self) -> None:
        m, dep, core = self._m, self.deployment, self.core
        now = time.monotonic()
        fleet = core.follower.workers
        for name in [n for n in self._shown if n not in fleet]:
            self._clear(name, self._shown.pop(name))
        for rec in fleet.values():
            t = {"deployment": dep, "worker": rec.name}
            met = rec.metrics or {}
            m["kvroute_worker_in_flight_requests"].set(core.in_flight(rec.name), tags=t)
            m["kvroute_worker_running_requests"].set(met.get("request_active_slots", 0), tags=t)
            m["kvroute_worker_waiting_requests"].set(met.get("num_requests_waiting", 0), tags=t)
            m["kvroute_worker_kv_usage_ratio"].set(met.get("gpu_cache_usage_perc", 0.0), tags=t)
            m["kvroute_worker_metrics_age_seconds"].set(
                -1.0 if rec.metrics_at is None else now - rec.metrics_at, tags=t)
            kvf = core.kv_follower
            m["kvroute_worker_exact_blocks"].set(
                core.exact.blocks(rec.name) if kvf is not None and rec.name in kvf.synced else -1.0, tags=t)
            for s in _STATES:
                m["kvroute_worker_state"].set(1.0 if rec.state == s else 0.0, tags={**t, "state": s})
            shown = self._shown.setdefault(rec.name, set())
            for i, rm in enumerate(rec.ranks if len(rec.ranks) > 1 else ()):
                rank = str(rm.get("data_parallel_rank", i))
                rt = {**t, "rank": rank}
                m["kvroute_worker_rank_running_requests"].set(rm.get("request_active_slots", 0), tags=rt)
                m["kvroute_worker_rank_waiting_requests"].set(rm.get("num_requests_waiting", 0), tags=rt)
                m["kvroute_worker_rank_kv_usage_ratio"].set(rm.get("gpu_cache_usage_perc", 0.0), tags=rt)
                shown.add(rank)
        age = core.follower.snapshot_age_s()
        m["kvroute_snapshot_age_seconds"].set(-1.0 if age is None else age, tags={"deployment": dep})
        m["kvroute_aggregator_reachable"].set(1.0 if core.follower.connected else 0.0, tags={"deployment": dep})

    def _clear(self, worker: str, ranks: set[str]) -> None:
        """A worker gone from the fleet: every gauge of it at its "not there" value (see the class docstring)."""
        m, t = self._m, {"deployment": self.deployment, "worker": worker}
        for name in ("kvroute_worker_in_flight_requests", "kvroute_worker_running_requests",
                     "kvroute_worker_waiting_requests", "kvroute_worker_kv_usage_ratio"):
            m[name].set(0.0, tags=t)
        m["kvroute_worker_metrics_age_seconds"].set(-1.0, tags=t)
        m["kvroute_worker_exact_blocks"].set(-1.0, tags=t)
        for s in _STATES:
            m["kvroute_worker_state"].set(0.0, tags={**t, "state": s})
        for rank in ranks:
            rt = {**t, "rank": rank}
            for name in ("kvroute_worker_rank_running_requests", "kvroute_worker_rank_waiting_requests",
                         "kvroute_worker_rank_kv_usage_ratio"):
                m[name].set(0.0, tags=rt)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class ReplicaExporter:
    """A replica's figures: its collector's frame counts (as deltas) and TTFT of streamed replies."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._frames = _make("kvroute_replica_frames")
        self._ttft = _make("kvroute_replica_ttft_seconds")
        self._seen: dict[str, int] = {}

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds, tags={"worker": self.worker})

    def export_frames(self, book: "MetricsBook") -> None:
        counts = {"accepted": book.stats.frames_accepted, **{str(k): v for k, v in book.stats.refused.items()}}
        for outcome, n in counts.items():
            delta = n - self._seen.get(outcome, 0)
            if delta > 0:
                self._frames.inc(delta, tags={"worker": self.worker, "outcome": outcome})
                self._seen[outcome] = n
