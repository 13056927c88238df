"""Per-trial summaries, aggregation over repetitions, goal checks, the Markdown report and plots."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence

import numpy as np

from bench.loadgen import RequestResult

PCTS = (50, 90, 99)


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def summarize_trial(results: list[RequestResult], warmup_s: float, stats_before: dict[str, dict],
                    stats_after: dict[str, dict]) -> dict[str, Any]:
    """Metrics of one (target, trace) trial over requests sent at or after `warmup_s`."""
    measured = [r for r in results if r.sent_s >= warmup_s]
    ok = [r for r in measured if r.ok]
    errors = Counter((r.error or "?").split(":")[0] for r in measured if not r.ok)
    out: dict[str, Any] = {"requests": len(measured), "ok": len(ok), "errors": len(measured) - len(ok),
                           "error_kinds": dict(errors), "all_requests": len(results)}
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    # every measured request's figures, for tails pooled over repetitions (`pooled`)
    out["ttft_ms_all"] = [round(v * 1e3, 2) for v in ttft]
    out["e2e_ms_all"] = [round(v * 1e3, 2) for v in e2e]
    itl = [g for r in ok for g in r.itl_s]
    for name, vals in (("ttft", ttft), ("e2e", e2e), ("itl", itl)):
        for q in PCTS:
            out[f"{name}_p{q}_ms"] = _ms(pct(vals, q))
        out[f"{name}_mean_ms"] = _ms(statistics.fmean(vals)) if vals else None
    if ok:
        t_first = min(r.sent_s for r in ok)
        t_last = max(r.sent_s + (r.e2e_s or 0.0) for r in ok)
        span = max(t_last - t_first, 1e-9)
        out["span_s"] = span
        out["throughput_rps"] = len(ok) / span
        out["output_tps"] = sum(r.completion_tokens or r.tokens for r in ok) / span
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        out["cache_hit"] = sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None
        out["prompt_tokens"] = prompt
    else:
        out.update(span_s=None, throughput_rps=0.0, output_tps=0.0, cache_hit=None, prompt_tokens=0)
    # engine view over the whole trial (warm-up included): requests and cache hits per worker
    per_worker = {}
    for name in sorted(stats_after):
        a, b = stats_after[name], stats_before.get(name, {})
        per_worker[name] = {
            "requests": a["requests_finished_total"] - b.get("requests_finished_total", 0)
            + a["requests_aborted_total"] - b.get("requests_aborted_total", 0),
            "prompt_tokens": a["prompt_tokens_total"] - b.get("prompt_tokens_total", 0),
            "cached_tokens": a["cached_tokens_total"] - b.get("cached_tokens_total", 0),
            "evicted_pages": a["evicted_pages_total"] - b.get("evicted_pages_total", 0),
        }
    out["per_worker"] = per_worker
    counts = [w["requests"] for w in per_worker.values()]
    mean = statistics.fmean(counts) if counts else 0.0
    out["spread_max_over_mean"] = (max(counts) / mean) if mean else None
    out["spread_cv"] = (statistics.pstdev(counts) / mean) if mean and len(counts) > 1 else None
    tp = sum(w["prompt_tokens"] for w in per_worker.values())
    out["engine_cache_hit"] = sum(w["cached_tokens"] for w in per_worker.values()) / tp if tp else None
    # where the router sent each shared-prefix group / conversation (when the target names the worker)
    named = [r for r in results if r.worker]
    if named:
        by_key: dict[Any, Counter] = defaultdict(Counter)
        for r in named:
            key = r.group if r.group is not None else r.sid
            by_key[key][r.worker] += 1
        multi = [c for c in by_key.values() if sum(c.values()) > 1]
        if multi:
            out["affinity"] = sum(max(c.values()) for c in multi) / sum(sum(c.values()) for c in multi)
            out["workers_per_key"] = statistics.fmean(len(c) for c in multi)
    return out


METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms",
           "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "throughput_rps", "output_tps", "cache_hit",
           "engine_cache_hit", "spread_max_over_mean", "spread_cv", "affinity", "workers_per_key", "foreign_cores",
           "bench_cores")


def aggregate(trials: Iterable[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, dict[str, Any]]:
    """Group trial summaries by `keys` and give, per metric, the mean and the sample std over reps."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for t in trials:
        groups[tuple(t[k] for k in keys)].append(t)
    out = {}
    for k, ts in groups.items():
        agg: dict[str, Any] = {"reps": len(ts), "requests": sum(t["summary"]["requests"] for t in ts),
                               "errors": sum(t["summary"]["errors"] for t in ts)}
        for m in METRICS:
            vals = [t["summary"].get(m) for t in ts]
            vals = [v for v in vals if v is not None]
            if vals:
                agg[m] = statistics.fmean(vals)
                agg[m + "_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
            else:
                agg[m] = None
                agg[m + "_sd"] = None
        per_worker: dict[str, int] = defaultdict(int)
        for t in ts:
            for w, d in t["summary"]["per_worker"].items():
                per_worker[w] += d["requests"]
        agg["per_worker_requests"] = dict(sorted(per_worker.items()))
        out[k] = agg
    return out


def bootstrap_ci(values: Sequence[float], q: float, *, n_boot: int = 1000, seed: int = 0,
                 alpha: float = 0.05) -> tuple[float, float, float] | None:
    """The q-th percentile of `values` with a (1 − alpha) percentile-bootstrap interval:
    (estimate, low, high). Resamples the requests themselves (they are pooled over repetitions)."""
    if len(values) < 2:
        return None
    a = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(n_boot, len(a)))
    boots = np.percentile(a[idx], q, axis=1)
    lo, hi = np.percentile(boots, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(np.percentile(a, q)), float(lo), float(hi)


def ratio_ci(num: Sequence[float], den: Sequence[float], q: float, *, n_boot: int = 1000, seed: int = 0,
             alpha: float = 0.05) -> tuple[float, float, float] | None:
    """percentile_q(num) / percentile_q(den) with a bootstrap interval (both resampled
    independently): a goal "ratio ≤ r" is met only when the interval's high end is ≤ r."""
    if len(num) < 2 or len(den) < 2:
        return None
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    rng = np.random.default_rng(seed)
    pa = np.percentile(a[rng.integers(0, len(a), size=(n_boot, len(a)))], q, axis=1)
    pb = np.percentile(b[rng.integers(0, len(b), size=(n_boot, len(b)))], q, axis=1)
    r = pa / np.maximum(pb, 1e-12)
    lo, hi = np.percentile(r, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(np.percentile(a, q) / max(np.percentile(b, q), 1e-12)), float(lo), float(hi)


def pooled(trials: Iterable[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, dict[str, Any]]:
    """Per group of `keys`: every measured request's TTFT and E2E pooled over repetitions, the
    errors, and the pooled throughput (requests / summed spans)."""
    out: dict[tuple, dict[str, Any]] = {}
    for t in trials:
        k = tuple(t[x] for x in keys)
        g = out.setdefault(k, {"ttft": [], "e2e": [], "ok": 0, "requests": 0, "span_s": 0.0,
                               "cached": 0.0, "prompt": 0, "reps": 0})
        s = t["summary"]
        g["ttft"].extend(s.get("ttft_ms_all") or [])
        g["e2e"].extend(s.get("e2e_ms_all") or [])
        g["ok"] += s["ok"]
        g["requests"] += s["requests"]
        g["span_s"] += s.get("span_s") or 0.0
        g["prompt"] += s.get("prompt_tokens") or 0
        g["cached"] += (s.get("cache_hit") or 0.0) * (s.get("prompt_tokens") or 0)
        g["reps"] += 1
    for g in out.values():
        g["rps"] = g["ok"] / g["span_s"] if g["span_s"] else 0.0
        g["hit"] = g["cached"] / g["prompt"] if g["prompt"] else None
    return out


def fmt(v: Any, sd: Any = None, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    s = f"{v:,.{digits}f}"
    if sd is not None and sd > 0:
        s += f" ±{sd:,.{digits}f}"
    return s


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
