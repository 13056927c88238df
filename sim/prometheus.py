"""The sim's `/metrics`: SGLang's Prometheus names and labels, fed from the engine.

Scheduler gauges (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
`sglang:cache_hit_rate` = hit rate of the last prefill batch, as SGLang reports it) carry
`model_name, engine_type, tp_rank, pp_rank`; request counters and histograms carry
`model_name, is_streaming` like SGLang's tokenizer-manager metrics. Gauges are read from the
engine at scrape time (SGLang refreshes them at its log points; live values are more useful
here). `sim:cumulative_cache_hit_rate` is the sim's own: cached / prompt tokens since start.
Latencies are wall-clock seconds, as a client measures them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sim.engine import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 60.0, 120.0)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 90.0,
                120.0, 180.0, 300.0, 600.0)


class SimMetrics:
    """One registry per server (no process-global state), rendered by `render(stats)`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        self._model = model_name
        sched = list(self._sched)
        req = ["model_name", "is_streaming"]
        r = self.registry
        self.num_running_reqs = Gauge("sglang:num_running_reqs", "The number of running requests.", sched, registry=r)
        self.num_queue_reqs = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", sched, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "The token usage.", sched, registry=r)
        self.num_used_tokens = Gauge("sglang:num_used_tokens", "The number of used tokens.", sched, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", sched, registry=r)
        self.max_total_num_tokens = Gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.", sched, registry=r
        )
        self.cumulative_hit_rate = Gauge(
            "sim:cumulative_cache_hit_rate", "Cached prompt tokens / prompt tokens since start.", sched, registry=r
        )
        self.prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", req, registry=r)
        self.generation_tokens = Counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", req, registry=r
        )
        self.cached_tokens = Counter("sglang:cached_tokens_total", "Number of cached prompt tokens.", req, registry=r)
        self.num_requests = Counter("sglang:num_requests_total", "Number of requests processed.", req, registry=r)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", req,
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", req,
            buckets=_E2E_BUCKETS, registry=r,
        )

    def observe_request(
        self, *, streaming: bool, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
        ttft_s: float | None, e2e_s: float,
    ) -> None:
        labels = {"model_name": self._model, "is_streaming": str(streaming).lower()}
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.cached_tokens.labels(**labels).inc(cached_tokens)
        self.generation_tokens.labels(**labels).inc(completion_tokens)
        self.num_requests.labels(**labels).inc()
        if ttft_s is not None:
            self.ttft.labels(**labels).observe(ttft_s)
        self.e2e.labels(**labels).observe(e2e_s)

    def render(self, stats: EngineStats) -> bytes:
        s = self._sched
        self.num_running_reqs.labels(**s).set(stats.num_running_reqs)
        self.num_queue_reqs.labels(**s).set(stats.num_waiting_reqs)
        self.token_usage.labels(**s).set(stats.token_usage)
        self.num_used_tokens.labels(**s).set(stats.used_tokens)
        self.cache_hit_rate.labels(**s).set(stats.last_prefill_cache_hit_rate)
        self.max_total_num_tokens.labels(**s).set(stats.max_total_num_tokens)
        self.cumulative_hit_rate.labels(**s).set(stats.cumulative_cache_hit_rate)
        return generate_latest(self.registry)
