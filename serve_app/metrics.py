"""Prometheus metrics of one router replica (`GET /metrics`), names prefixed `kvroute_`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serve_app.breaker import STATE_CODE

if TYPE_CHECKING:
    from serve_app.breaker import Breakers
    from serve_app.router import RouterCore

_STATES = ("live", "idle", "down")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _FleetCollector(Collector):
    """Per-worker gauges read from the replica's snapshot at scrape time (never stale copies)."""

    def __init__(self, core: "RouterCore", breakers: "Breakers") -> None:
        self.core = core
        self.breakers = breakers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running = GaugeMetricFamily("kvroute_worker_running_requests", "Reported running requests", labels=["worker"])
        waiting = GaugeMetricFamily("kvroute_worker_waiting_requests", "Reported queued requests", labels=["worker"])
        kv = GaugeMetricFamily("kvroute_worker_kv_usage_ratio", "Reported KV cache use (0..1)", labels=["worker"])
        inflight = GaugeMetricFamily("kvroute_worker_in_flight_requests",
                                     "Requests this replica dispatched and not finished", labels=["worker"])
        state = GaugeMetricFamily("kvroute_worker_state", "1 for the worker's current state", labels=["worker", "state"])
        breaker = GaugeMetricFamily("kvroute_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open",
                                    labels=["worker"])
        silent = GaugeMetricFamily(
            "kvroute_worker_kv_events_silent",
            "1 when the worker's KV-event subscription heard nothing while its engine held KV pages "
            "(exact prefix mode is blind for it: check which side binds --kv-events-config)", labels=["worker"])
        batches = CounterMetricFamily("kvroute_worker_kv_event_batches", "KV-event batches the worker's actor "
                                      "received (as of its last report)", labels=["worker"])
        # an attention-DP worker's ranks, each a routing target of its own (the per-worker series above
        # sum them: running/waiting/in-flight summed, KV use as the worker's report gives it)
        r_running = GaugeMetricFamily("kvroute_worker_rank_running_requests", "Reported running requests of one "
                                      "attention-DP rank (DP workers only)", labels=["worker", "rank"])
        r_waiting = GaugeMetricFamily("kvroute_worker_rank_waiting_requests", "Reported queued requests of one "
                                      "attention-DP rank (DP workers only)", labels=["worker", "rank"])
        r_kv = GaugeMetricFamily("kvroute_worker_rank_kv_usage_ratio", "Reported KV cache use (0..1) of one "
                                 "attention-DP rank (DP workers only)", labels=["worker", "rank"])
        r_inflight = GaugeMetricFamily("kvroute_worker_rank_in_flight_requests", "Requests this replica dispatched "
                                       "to one attention-DP rank and not finished (DP workers only)",
                                       labels=["worker", "rank"])
        role = GaugeMetricFamily("kvroute_worker_role", "1 for the worker's prefill/decode role (PD workers only; "
                                 "join on worker)", labels=["worker", "role"])
        model = GaugeMetricFamily("kvroute_worker_model", "1 for each model name the worker serves (join on worker; "
                                  "none for a worker that declares no model)", labels=["worker", "model"])
        for rec in self.core.follower.workers.values():
            for name in rec.models:
                model.add_metric([rec.name, name], 1.0)
            kv_info = rec.kv_events
            if kv_info is not None:
                silent.add_metric([rec.name], 1.0 if kv_info.status == "silent" else 0.0)
                batches.add_metric([rec.name], float(kv_info.batches))
            m = rec.metrics or {}
            running.add_metric([rec.name], m.get("request_active_slots", 0))
            waiting.add_metric([rec.name], m.get("num_requests_waiting", 0))
            kv.add_metric([rec.name], m.get("gpu_cache_usage_perc", 0.0))
            inflight.add_metric([rec.name], self.core.in_flight(rec.name))
            for s in _STATES:
                state.add_metric([rec.name, s], 1.0 if rec.state == s else 0.0)
            if rec.role != "both":
                role.add_metric([rec.name, rec.role], 1.0)
            targets = self.core.targets(rec.name)
            if len(targets) > 1:
                by_rank = {r.get("data_parallel_rank", 0): r for r in rec.ranks}
                for rank, target in enumerate(targets):
                    rm, lbl = by_rank.get(rank) or {}, [rec.name, str(rank)]
                    r_running.add_metric(lbl, rm.get("request_active_slots", 0))
                    r_waiting.add_metric(lbl, rm.get("num_requests_waiting", 0))
                    r_kv.add_metric(lbl, rm.get("gpu_cache_usage_perc", 0.0))
                    r_inflight.add_metric(lbl, self.core.ledger.in_flight(target))
            breaker.add_metric([rec.name], STATE_CODE[self.breakers.state(rec.name)])
        age = self.core.follower.snapshot_age_s()
        snap = GaugeMetricFamily("kvroute_snapshot_age_seconds", "Time since the aggregator last answered")
        snap.add_metric([], -1.0 if age is None else age)
        up = GaugeMetricFamily("kvroute_aggregator_reachable", "1 if the aggregator's snapshot stream is connected")
        up.add_metric([], 1.0 if self.core.follower.connected else 0.0)
        tok = CounterMetricFamily("kvroute_tokenize_failures", "Prompts the configured tokenizer or chat "
                                  "template refused (routed with approximate prefix affinity)")
        tok.add_metric([], self.core.tokenize_failures)
        yield from (running, waiting, kv, inflight, state, breaker, snap, up, tok, silent, batches, model,
                    r_running, r_waiting, r_kv, r_inflight, role)


class RouterMetrics:
    """Counters and histograms recorded on the request path (O(1) each)."""

    def __init__(self, core: "RouterCore", breakers: "Breakers") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # `model`: the model the request named, when some worker declares it ("" on a model-agnostic
        # fleet, and for a name only model-agnostic workers take: never a label from arbitrary input)
        self.requests = Counter("kvroute_requests", "Requests by policy, model, worker and outcome",
                                ["policy", "model", "worker", "outcome"], registry=r)
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds", "Time to choose a worker (policy + ledger + prefix lookup)",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2), registry=r)
        self.ttft_seconds = Histogram("kvroute_upstream_ttft_seconds", "Dispatch to first upstream byte",
                                      ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.duration_seconds = Histogram("kvroute_upstream_duration_seconds", "Dispatch to end of response",
                                          ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.admission_held_seconds = Histogram(
            "kvroute_admission_held_seconds", "Time a big streamed prompt waited in the router for a worker to "
            "free up (router.admission; only held requests are observed)", buckets=_LATENCY_BUCKETS, registry=r)
        self.retries = Counter("kvroute_retries", "Attempts retried on another worker, by failed worker",
                               ["worker"], registry=r)
        # the router checking its predictions (serve_app.prediction): engine-reported vs predicted reuse
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "Prompt tokens of answered requests, as the "
                                     "engine counted them (usage.prompt_tokens)", ["worker", "model"], registry=r)
        self.cached_tokens = Counter("kvroute_prompt_tokens_cached", "Prompt tokens the engine served from its "
                                     "prefix cache (usage.prompt_tokens_details.cached_tokens)", ["worker", "model"],
                                     registry=r)
        self.predicted_cached_tokens = Counter(
            "kvroute_prompt_tokens_predicted_cached", "Prompt tokens kvroute predicted the chosen worker's cache "
            "would serve (the blocks the ledger charged as cached)", ["worker", "model"], registry=r)
        self.prediction_error = Histogram(
            "kvroute_prompt_cache_prediction_error", "Per request: (predicted − engine-reported cached tokens) / "
            "prompt tokens; > 0 predicted hits that did not happen, < 0 hits that were not predicted", ["worker"],
            buckets=(-1.0, -0.75, -0.5, -0.25, -0.1, -0.01, 0.01, 0.1, 0.25, 0.5, 0.75, 1.0), registry=r)
        self.breaker_opened = Counter("kvroute_breaker_opened", "Times a worker's breaker opened", ["worker"],
                                      registry=r)
        r.register(_FleetCollector(core, breakers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
