"""Turn one run's document into bench/results/<stem>.md, <stem>.json and <stem>-*.png."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import report
from bench.report import fmt, ratio

KV = "kvroute-kv_aware"
RR = "kvroute-round_robin"
SGL_CA = "sglang-cache_aware"
SERVE = "serve-random"
DIRECT = "direct"
GOAL_WORKLOADS = ("shared_prefix", "multi_turn")
CONTROL = "no_sharing"
TARGET_ORDER = ["direct", "serve-random", "kvroute-round_robin", "kvroute-power_of_two", "kvroute-least_loaded",
                "kvroute-kv_aware", "kvroute-kv_aware-exact", "sglang-round_robin", "sglang-power_of_two", "sglang-cache_aware", "ray-prefix"]
WORKLOAD_TITLES = {"shared_prefix": "shared prefix", "multi_turn": "multi-turn chat", "no_sharing": "no sharing (control)",
                   "multi_lora": "multi-LoRA (8 adapters, Zipf, shared system prompt)"}


def _order(names) -> list[str]:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (TARGET_ORDER.index(n) if n in TARGET_ORDER else 99, n))


def overhead_agg(rows: list[dict]) -> dict[tuple[int, str], dict[str, Any]]:
    g: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in rows:
        g[(r["concurrency"], r["target"])].append(r)
    out = {}
    for k, rs in g.items():
        d: dict[str, Any] = {"reps": len(rs), "requests": sum(r["requests"] for r in rs), "errors": sum(r["errors"] for r in rs)}
        for m in ("e2e_p50_ms", "e2e_p99_ms", "e2e_mean_ms", "ttft_p50_ms", "rps"):
            vals = [r[m] for r in rs if r[m] is not None]
            d[m] = statistics.fmean(vals) if vals else None
            d[m + "_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        out[k] = d
    return out


def _diag(agg, w, rate, a, b) -> str:
    A, B = agg.get((w, rate, a)), agg.get((w, rate, b))
    if not A or not B:
        return ""
    parts = [f"TTFT p50 {fmt(A['ttft_p50_ms'])} vs {fmt(B['ttft_p50_ms'])} ms",
             f"cache hit {fmt((A['cache_hit'] or 0) * 100)}% vs {fmt((B['cache_hit'] or 0) * 100)}%",
             f"load spread max/mean {fmt(A['spread_max_over_mean'], digits=2)} vs {fmt(B['spread_max_over_mean'], digits=2)}",
             f"req/s {fmt(A['throughput_rps'], digits=1)} vs {fmt(B['throughput_rps'], digits=1)} (offered {rate:g})"]
    if A.get("errors") or B.get("errors"):
        parts.append(f"errors {A['errors']} vs {B['errors']}")
    return "; ".join(parts)


def evaluate_goals(agg: dict, rates: dict[str, list[float]], oh: dict) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []

    def add(goal, w, rate, value, threshold, met, why, cmp="≤"):
        goals.append({"goal": goal, "workload": w, "rate": rate, "value": value, "threshold": threshold,
                      "comparison": cmp, "met": met, "detail": why})

    for w in GOAL_WORKLOADS:
        for rate in rates.get(w, []):
            kv = agg.get((w, rate, KV))
            for other, thr, name in ((RR, 0.5, "kv_aware TTFT p99 ≤ 0.5× kvroute round_robin"),
                                     (SGL_CA, 0.8, "kv_aware TTFT p99 ≤ 0.8× sglang-router cache_aware")):
                o = agg.get((w, rate, other))
                if not kv or not o:
                    continue
                r = ratio(kv["ttft_p99_ms"], o["ttft_p99_ms"])
                add(name, w, rate, r, thr, r is not None and r <= thr, _diag(agg, w, rate, KV, other))
        top = max(rates.get(w, [0]))
        kv, o = agg.get((w, top, KV)), agg.get((w, top, SGL_CA))
        if kv and o:
            r = ratio(kv["throughput_rps"], o["throughput_rps"])
            rt = ratio(kv["output_tps"], o["output_tps"])
            sat = [n for n, x in ((KV, kv), (SGL_CA, o)) if x["throughput_rps"] and x["throughput_rps"] < 0.9 * top]
            why = _diag(agg, w, top, KV, SGL_CA) + f"; output tok/s ratio {fmt(rt, digits=2)}; "
            why += (f"below 90% of the offered rate (saturated): {', '.join(sat)}" if sat else
                    "neither is saturated at this rate: both carry the offered load, so their throughput is equal by "
                    "construction and this rate cannot show a 1.1× difference")
            add("throughput ≥ 1.1× sglang-router cache_aware (top rate)", w, top, r, 1.1,
                r is not None and r >= 1.1, why, "≥")
    for rate in rates.get(CONTROL, []):
        kv, o = agg.get((CONTROL, rate, KV)), agg.get((CONTROL, rate, RR))
        if not kv or not o:
            continue
        r99 = ratio(kv["ttft_p99_ms"], o["ttft_p99_ms"])
        r50 = ratio(kv["ttft_p50_ms"], o["ttft_p50_ms"])
        rt = ratio(kv["throughput_rps"], o["throughput_rps"])
        worse = (r99 is not None and r99 > 1.10) or (r50 is not None and r50 > 1.10) or (rt is not None and rt < 0.95)
        add("control: kv_aware never worse than round_robin (TTFT p50/p99 ≤ 1.10×, req/s ≥ 0.95×)", CONTROL, rate,
            r99, 1.10, not worse,
            f"TTFT p50 ratio {fmt(r50, digits=2)}, p99 ratio {fmt(r99, digits=2)}, req/s ratio {fmt(rt, digits=2)}; "
            + _diag(agg, CONTROL, rate, KV, RR))
    concs = sorted({c for c, _ in oh})
    for c in concs:
        d, s, k = oh.get((c, DIRECT)), oh.get((c, SERVE)), oh.get((c, KV))
        if not (d and s and k) or None in (d["e2e_p50_ms"], s["e2e_p50_ms"], k["e2e_p50_ms"]):
            continue
        add_k = k["e2e_p50_ms"] - d["e2e_p50_ms"]
        add_s = s["e2e_p50_ms"] - d["e2e_p50_ms"]
        r = add_k / add_s if add_s > 0 else None
        why = (f"concurrency {c}: added p50 {add_k:.2f} ms (kvroute kv_aware) vs {add_s:.2f} ms (bare Serve); "
               f"total p50 {k['e2e_p50_ms']:.2f} vs {s['e2e_p50_ms']:.2f} vs direct {d['e2e_p50_ms']:.2f} ms")
        if add_s <= 0:  # bare Serve beat direct here: no ratio; kvroute must then add no more than it
            why += "; bare Serve was faster than direct at this concurrency, so no ratio: met if kvroute adds no more"
        add("router added latency ≤ 1.15× bare Serve's (p50 e2e, tiny outputs)", "overhead", c, r, 1.15,
            (r <= 1.15) if r is not None else add_k <= add_s, why)
    return goals


# ------------------------------------------------------------------------------------ markdown


def _md_table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "|".join(["---"] + ["---:"] * (len(header) - 1))
    out = ["| " + " | ".join(header) + " |", "|" + align + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def render(doc: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Any]:
    trials = doc.get("trials", [])
    agg = report.aggregate(trials, ["workload", "rate", "target"])
    rates: dict[str, list[float]] = defaultdict(list)
    for (w, rate, _t) in agg:
        if rate not in rates[w]:
            rates[w].append(rate)
    for w in rates:
        rates[w].sort()
    targets = _order(t for (_w, _r, t) in agg) or _order(t["name"] for t in doc.get("targets", []))
    oh = overhead_agg(doc.get("overhead", []))
    goals = evaluate_goals(agg, rates, oh)
    doc["aggregate"] = [{"workload": w, "rate": r, "target": t, **v} for (w, r, t), v in sorted(agg.items())]
    doc["overhead_aggregate"] = [{"concurrency": c, "target": t, **v} for (c, t), v in sorted(oh.items())]
    doc["goals"] = goals
    plots = _plots(doc, agg, rates, targets, oh, out_dir, stem)
    doc["plots"] = plots
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(_markdown(doc, agg, rates, targets, oh, goals, plots))
    return doc


KV, CA, RR = "kvroute-kv_aware", "sglang-cache_aware", "kvroute-round_robin"


def _ci(v: tuple[float, float, float] | None, digits: int = 0) -> str:
    if v is None:
        return "—"
    est, lo, hi = v
    return f"{est:,.{digits}f} [{lo:,.{digits}f}, {hi:,.{digits}f}]"


def _pooled_section(doc: dict[str, Any], targets: list[str]) -> list[str]:
    """Tails pooled over every measured request of a cell (all repetitions), with bootstrap 95 %
    intervals; kv_aware's ratios to its yardsticks, a goal met only when its interval says so."""
    trials = [t for t in doc.get("trials", []) if t["summary"].get("ttft_ms_all") is not None]
    if not trials:
        return []
    pool = report.pooled(trials, ["workload", "rate", "target"])
    L = ["## Pooled tails (every measured request of a cell, all repetitions)\n",
         "Percentiles over the pooled requests with 95 % percentile-bootstrap intervals (1,000 resamples of "
         "the requests). Ratios are kvroute kv_aware's figure over the yardstick's, resampled independently; "
         "*met* means the whole interval is on the goal's side, *missed* the whole interval on the other, "
         "*open* that the interval straddles it.\n"]
    cells = sorted({(w, r) for (w, r, _t) in pool})
    for (w, rate) in cells:
        rows = []
        for t in targets:
            g = pool.get((w, rate, t))
            if g is None:
                continue
            rows.append([t, str(len(g["ttft"])), _ci(report.bootstrap_ci(g["ttft"], 50)),
                         _ci(report.bootstrap_ci(g["ttft"], 99)), _ci(report.bootstrap_ci(g["e2e"], 50)),
                         _ci(report.bootstrap_ci(g["e2e"], 99)),
                         f"{g['rps']:.2f}", fmt((g["hit"] or 0) * 100, digits=1), f"{g['requests'] - g['ok']}"])
        L.append(f"{w} @ {rate:g} req/s:\n")
        L.append(_md_table(["target", "requests", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms", "E2E p99 ms", "req/s",
                            "hit %", "errors"], rows))
        L.append("")
        dyn = _dynamo_goals(pool, w, rate)
        if dyn:
            L.append(_md_table(["kvroute vs Dynamo goal", "target", "ratio [95 % CI]", "verdict"], dyn))
            L.append("")
        kv = pool.get((w, rate, KV))
        goals = []
        ca_name = CA + "-nodelay" if (w, rate, CA + "-nodelay") in pool else CA  # the stricter yardstick
        for yard, q, limit in ((ca_name, 50, 0.8), (ca_name, 99, 0.8), (RR, 99, 1.0)):
            y = pool.get((w, rate, yard))
            if kv is None or y is None:
                continue
            r = report.ratio_ci(kv["ttft"], y["ttft"], q)
            if r is None:
                continue
            verdict = "met" if r[2] <= limit else ("missed" if r[1] > limit else "open")
            goals.append([f"TTFT p{q} ÷ {yard}", f"≤ {limit}", _ci(r, 2), verdict])
        if kv is not None and pool.get((w, rate, ca_name)) is not None:
            ca = pool[(w, rate, ca_name)]
            rr = kv["rps"] / ca["rps"] if ca["rps"] else None
            goals.append([f"throughput ÷ {ca_name}", "≥ 1.05", fmt(rr, digits=2),
                          "—" if rr is None else ("met" if rr >= 1.05 else "missed")])
            goals.append([f"cache hit vs {ca_name}", "≥", f"{(kv['hit'] or 0) * 100:.1f} vs {(ca['hit'] or 0) * 100:.1f} %",
                          "met" if (kv["hit"] or 0) >= (ca["hit"] or 0) else "missed"])
        # PD fleets (issue 19): p99 ≤ 0.8× sglang-router's PD mode (cache-aware prefill) at the same
        # throughput on shared prefixes; never worse than its PD round-robin (the no-sharing control)
        for yard, limit in (("sglang-pd-cache_aware", 0.8), ("sglang-pd-round_robin", 1.0)):
            y = pool.get((w, rate, yard))
            r = None if kv is None or y is None else report.ratio_ci(kv["ttft"], y["ttft"], 99)
            if r is None:
                continue
            verdict = "met" if r[2] <= limit else ("missed" if r[1] > limit else "open")
            goals.append([f"TTFT p99 ÷ {yard}", f"≤ {limit}", _ci(r, 2), verdict])
            if y["rps"]:
                goals.append([f"throughput ÷ {yard}", "same", fmt(kv["rps"] / y["rps"], digits=2), "—"])
        if goals:
            L.append(_md_table(["kv_aware goal", "target", "ratio [95 % CI]", "verdict"], goals))
            L.append("")
    return L


# issue 34: kvroute kv_aware against Dynamo's KV router on the same events — exact mode (KV events) next
# to Dynamo's defaults, approximate mode next to Dynamo without KV events
DYNAMO_PAIRS = (("kvroute-kv_aware-exact", "dynamo-kv"), ("kvroute-kv_aware", "dynamo-kv-approx"))


def _verdict(r: tuple[float, float, float], limit: float, cmp: str = "≤") -> str:
    if cmp == "≤":
        return "met" if r[2] <= limit else ("missed" if r[1] > limit else "open")
    return "met" if r[1] >= limit else ("missed" if r[2] < limit else "open")


def _dynamo_goals(pool: dict, w: str, rate: float) -> list[list[str]]:
    """TTFT p50 and p99 ≤ 0.9× Dynamo's, throughput ≥ 1.0×, hit ≥, E2E p50 and p99 ≤ 1.0× Dynamo's and
    sglang-router cache_aware's (TCP_NODELAY), for each kvroute mode whose Dynamo counterpart ran."""
    rows: list[list[str]] = []
    ca = pool.get((w, rate, CA + "-nodelay")) or pool.get((w, rate, CA))
    for mine, theirs in DYNAMO_PAIRS:
        k, d = pool.get((w, rate, mine)), pool.get((w, rate, theirs))
        if k is None or d is None:
            continue
        for q in (50, 99):
            r = report.ratio_ci(k["ttft"], d["ttft"], q)
            if r is not None:
                rows.append([f"{mine} TTFT p{q} ÷ {theirs}", "≤ 0.9", _ci(r, 2), _verdict(r, 0.9)])
        rr = k["rps"] / d["rps"] if d["rps"] else None
        rows.append([f"{mine} throughput ÷ {theirs}", "≥ 1.0", fmt(rr, digits=3),
                     "—" if rr is None else ("met" if rr >= 0.995 else "missed")])  # equal within 0.5 %
        rows.append([f"{mine} cache hit vs {theirs}", "≥", f"{(k['hit'] or 0) * 100:.1f} vs {(d['hit'] or 0) * 100:.1f} %",
                     "met" if (k["hit"] or 0) >= (d["hit"] or 0) else "missed"])
        for yard_name, y in ((theirs, d), (CA + "-nodelay", ca)):
            if y is None:
                continue
            for q in (50, 99):
                r = report.ratio_ci(k["e2e"], y["e2e"], q)
                if r is not None:
                    rows.append([f"{mine} E2E p{q} ÷ {yard_name}", "≤ 1.0", _ci(r, 2), _verdict(r, 1.0)])
    return rows


def _cpu_per_request(doc: dict[str, Any], targets: list[str]) -> list[str]:
    """Per workload × rate: each target's CPU per completed request, by process family (bench.cpu)."""
    cells: dict[tuple[str, float], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for t in doc.get("trials", []):
        if (t["summary"].get("cpu") or {}).get("families_cpu_s") is not None:
            cells[(t["workload"], t["rate"])][t["target"]].append(t)
    if not cells:
        return []
    L = ["## CPU per request, by process family\n",
         "CPU milliseconds per request during each trial (process CPU time ÷ the requests answered in the trial, "
         "warm-up included; families in "
         "`bench/cpu.py`). *Router side*: for kvroute its router replica, the Serve ingress (HAProxy + its "
         "manager + Serve's proxy actor), the Serve controller, kvroute's metrics plane (the aggregator, "
         "worker actors) and Ray's own processes; for sglang-router its one process. The load generator is the "
         "benchmark's own process; its share of the machine is shown so that it is never what saturates it.\n"]
    for (w, rate) in sorted(cells):
        rows = []
        for tname in targets:
            ts = cells[(w, rate)].get(tname)
            if not ts:
                continue

            def per_req(key: str, fams: tuple[str, ...] = ()) -> str:
                vals = []
                for t in ts:
                    f = t["summary"]["cpu"]["families_cpu_s"]
                    ok = max(1, t["summary"]["ok"])
                    if key:
                        v = t["summary"].get(key)
                        if v is None:
                            return "–"
                        vals.append(v)
                    else:
                        vals.append(sum(v for k, v in f.items() if k in fams) / ok * 1e3)
                return f"{statistics.fmean(vals):.2f}"

            app = "kvroute" if tname == "kvroute-kv_aware" else tname
            mine = f"router:{tname}" if tname.startswith("dynamo-") else f"replica:{app}"  # a Dynamo proxy's process
            lg = [t["summary"]["cpu"]["families_cpu_s"].get("load generator", 0.0) / t["summary"]["cpu"]["seconds"]
                  for t in ts]
            busy = [t["summary"]["cpu"]["busy_cores"] for t in ts]
            rows.append([tname, per_req("router_cpu_ms_per_req"), per_req("", (mine,)),
                         per_req("", ("ingress",)), per_req("", ("serve controller",)),
                         per_req("", ("metrics plane",)), per_req("", ("ray system",)),
                         per_req("", ("peer router",)), per_req("engines_cpu_ms_per_req"),
                         per_req("loadgen_cpu_ms_per_req"), f"{statistics.fmean(lg):.2f}",
                         f"{statistics.fmean(busy):.2f}"])
        L.append(f"{w} @ {rate:g} req/s:\n")
        L.append(_md_table(["target", "router side", "its replica", "ingress", "controller", "metrics plane",
                            "Ray", "peer router", "engines", "load gen", "load gen cores", "machine busy cores"],
                           rows))
        L.append("")
    return L


def _models_line(doc: dict[str, Any], models: list[str], workers: int) -> str:
    """Multi-model fleet: which worker serves which model, and per target whether every request
    reached a worker of its own model (the engines' own counts, `bench.run.model_check`)."""
    share = {m: [f"sim-{i}" for i in range(workers) if models[i * len(models) // workers] == m] for m in models}
    checks = defaultdict(lambda: [0, 0])
    for t in doc.get("trials", []):
        for c in (t["summary"].get("models") or {}).values():
            checks[t["target"]][0] += c["sent"]
            checks[t["target"]][1] += c["served_by_its_workers"]
    ok = ", ".join(f"{n} {served}/{sent}" for n, (sent, served) in sorted(checks.items()))
    return ("- Models: " + "; ".join(f"`{m}` on {', '.join(ws)}" for m, ws in share.items())
            + ". Every shared-prefix group (else every conversation) asks for one model, groups alternating. "
              f"Requests that reached a worker of their own model / requests sent, per target: {ok}.")


def _markdown(doc, agg, rates, targets, oh, goals, plots) -> str:
    cfg = doc["config"]
    m = doc["machine"]
    L: list[str] = []
    L.append(f"# kvroute side-by-side benchmark — `{doc['suite']}` suite\n")
    L.append(f"Command: `{doc['command']}`" + (f" (overrides: {', '.join(doc['overrides'])})" if doc.get("overrides") else ""))
    L.append(f"\nStarted {doc['started_at']}; total {doc.get('elapsed_s', '?')} s (fleet + targets up in "
             f"{doc.get('startup_s', '?')} s).\n")
    L.append(f"Machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('memory_gb', '?')} GB; {m.get('platform')}; "
             f"Python {m.get('python')}; Ray {m.get('ray', '?')}; sglang-router {m.get('sglang_router', '?')}; "
             f"aiohttp {m.get('aiohttp', '?')}. Load average at start {doc.get('loadavg_start')}, at end "
             f"{doc.get('loadavg_end')} (the machine is shared: other jobs ran during the measurement).")
    L.append(f"Code: git `{m.get('git_commit', '?')[:12]}`"
             + (f", uncommitted changes in {len(m['git_dirty_paths'])} path(s) under actors/ serve_app/ sim/"
                if m.get("git_dirty_paths") else "") + ".\n")

    L.append("## Setup\n")
    eng = cfg["engine"]
    if len(cfg.get("models") or ()) > 1:
        L.append(_models_line(doc, cfg["models"], cfg["workers"]))
    L.append(f"- Fleet: {cfg['workers']} simulated SGLang workers (`python -m sim`, launched by kvroute's own "
             f"`FleetRunner` as managed workers), identical engine arguments: "
             + ", ".join(f"`{k}={v}`" for k, v in eng.items())
             + ". Timing model: sim defaults (Llama-3.1-8B on H100: prefill 5 ms + 60 µs/uncached token; decode "
               "8 ms + 0.15 ms/request + 40 ns/KV token per step).")
    if cfg.get("dp_size", 1) > 1:
        L.append(f"- DP attention: each worker runs `--dp-size {cfg['dp_size']}` (that many ranks behind one server, "
                 "each with the engine arguments above: its own scheduler, KV pool, KvMetrics and KV events); kvroute's "
                 "fleet entries say `dp_size` and its policies pick worker and rank; "
                 + ("sglang-router's PD mode runs without `--dp-aware` (0.3.2's `--dp-aware` in PD mode sends to "
                    "`url@rank` as a URL and every request fails, docs/pd.md): SGLang places each prefill on "
                    "`bootstrap_room % dp_size` and each decode round robin; kvroute pins both ranks."
                    if cfg.get("pd") else "sglang-router runs `--dp-aware`."))
    pd = cfg.get("pd")
    if pd:
        L.append(f"- Prefill/decode disaggregation ([docs/pd.md](../../docs/pd.md)): the {cfg['workers']} workers are "
                 f"{pd[0]} prefill sims (`--disaggregation-mode prefill`, each with its bootstrap port) and {pd[1]} "
                 f"decode sims (`--disaggregation-mode decode`); KV transfer modelled at 1 ms + 5 µs per uncached "
                 f"prompt token. Every target sends each request to a prefill and a decode sim with the same "
                 f"bootstrap room and relays the decode sim's stream; the cache hit counts both kinds of sim.")
    pool = eng.get("max_total_num_tokens")
    sp = cfg["workloads"].get("shared_prefix", {}).get("params", {})
    fit = ""
    if pool and sp.get("system_tokens"):
        per = pool // sp["system_tokens"]
        holders = pd[0] if pd else cfg["workers"]
        fit = (f" The KV pool ({pool:,} tokens per worker) holds {per} shared-prefix system prompts "
               f"({per * holders} in the fleet's {'prefill sims' if pd else 'workers'} for {sp.get('groups')} groups), "
               f"so where a request lands decides "
               f"whether its prefix is cached, and every group kept on two workers evicts another.")
    L.append(f"- `time_scale` {eng.get('time_scale', 1.0)}: every time in this report is wall-clock milliseconds and "
             f"equals simulated time." + fit)
    L.append(f"- Trials: {cfg['reps']} repetitions × each workload × each rate; within a (repetition, workload, rate) "
             f"cell one seeded trace is driven through every target in a shuffled order; the workers' prefix caches "
             f"are flushed (`POST /flush_cache`) before every target. Arrival window {cfg['duration_s']} s; requests "
             f"sent in the first {cfg['warmup_s']} s are excluded (warm-up). Each cell has its own seed, so no router "
             f"has seen a trace's prefixes before it runs it. Values are the mean over repetitions, ± the sample "
             f"standard deviation across repetitions.")
    L.append("- Load generator: one asyncio process, aiohttp, streamed `/v1/chat/completions` with "
             "`stream_options.include_usage`; open-loop session starts (Poisson, or the trace's own arrivals). TTFT = first chunk carrying text; "
             "ITL = gaps between text chunks (pooled); throughput = completed measured requests / (last end − first "
             "send); cache hit = Σ cached_tokens / Σ prompt_tokens of measured responses (engine-reported); load "
             "spread = requests per worker from `/sim/stats` deltas (whole trial).")
    if cfg.get("stream_batching_ms"):
        L.append(f"- Streams through kvroute and the Serve-based targets are relayed batched "
                 f"(`stream_batching_interval_ms` = {cfg['stream_batching_ms']:g}, kvroute's default): the first two "
                 f"SSE events (role chunk, first token) at once, later tokens in batches at most that often, the end "
                 f"at once{' (kvroute: in a reply longer than one interval, with the next batch — `stream_batching_hold_reads`)' if cfg.get('stream_hold_reads') else ''}. "
                 f"Their ITL is that of a batched stream (gaps of 0 within a batch); sglang-router and "
                 f"`direct` relay every event as it comes.")
    if cfg.get("kv_events"):
        L.append("- The engines publish SGLang KV events and `kvroute-kv_aware-exact` runs kvroute's exact prefix mode. "
                 "**Caveat for code before serve_app commit d4a918b:** there, kvroute's default-mode routers (all "
                 "other kvroute targets) also followed the KV events and replaced their own prefix-index overlap "
                 "with the exact index's, computed from text-hashed blocks that never match the engines' "
                 "token-block hashes, so their overlap was always 0.")
    else:
        L.append("- The engines do not publish KV events, so kvroute runs in its default (approximate) prefix mode: "
                 "the router's record of which prompts it sent where. (`--kv-events` adds kvroute's exact mode as "
                 "a target; see `quick-kv-events.md`.)")
    L.append("\nWorkloads:\n")
    for w, spec in cfg["workloads"].items():
        L.append(f"- **{w}**: rates {spec['rates']} req/s; " + ", ".join(f"{k}={v}" for k, v in spec["params"].items()))
    if "multi_turn" in cfg["workloads"]:
        L.append("  (multi-turn: conversations start as a Poisson process at rate/turns; each turn resends the whole "
                 "history including the previous assistant replies as received, after an exponential think time.)")
    if "multi_lora" in cfg["workloads"]:
        L.append("  (multi_lora: one system prompt shared by every request, each for one of the adapters "
                 "(`model: \"kvroute-sim:loraK\"`, SGLang's form), drawn with Zipf popularity; every worker has all "
                 "of them loaded (/load_lora_adapter before the trials). The engines cache the system prompt once "
                 "per adapter: as text every request shares it, only the adapter says where it is cached.)")
    L.append("\nTargets:\n")
    for t in doc.get("targets", []):
        L.append(f"- `{t['name']}` — {t['label']}" + (f". {t['notes']}" if t.get("notes") else ""))
    L.append("")

    if doc.get("notes"):
        L.append("## Reading of this run\n")
        L.append(doc["notes"].strip() + "\n")
    budget = cfg.get("budget_s")
    if budget and doc.get("elapsed_s") and doc["elapsed_s"] > budget:
        L.append(f"**This run took {doc['elapsed_s']:.0f} s, over the suite's {budget} s budget** "
                 f"(other jobs on the machine: see *CPU during the trials*).\n")

    # goals
    L.append("## Goals\n")
    if goals:
        rows = []
        for g in goals:
            rows.append([g["goal"], g["workload"], f"{g['rate']:g}", fmt(g["value"], digits=2),
                         f"{g['comparison']} {g['threshold']}", "**met**" if g["met"] else "**MISSED**", g["detail"]])
        L.append(_md_table(["goal", "workload", "rate / conc.", "measured", "target", "", "details (kv_aware vs other)"],
                           rows, "---|---|---:|---:|---|---|---"))
        L.append("")
        for name in dict.fromkeys(g["goal"] for g in goals):
            gs = [g for g in goals if g["goal"] == name]
            n_met = sum(g["met"] for g in gs)
            L.append(f"- {name}: met in {n_met} of {len(gs)} cases.")
    else:
        L.append("(not evaluated: a target needed for the goals did not run)")
    L.append("")

    # headline
    L.append("## Headline: kv_aware vs the others\n")
    L.append("TTFT p99 (ms) at each rate; cache hit, req/s and output tok/s at the top rate; last column: kv_aware's "
             "TTFT p99 divided by the target's at the top rate (< 1 = kv_aware better).\n")
    for w in rates:
        top = rates[w][-1]
        header = ["target"] + [f"p99 @{r:g}/s" for r in rates[w]] + ["hit % @top", "req/s @top", "tok/s @top",
                                                                      "kv_aware / target"]
        rows = []
        kvtop = agg.get((w, top, KV))
        for t in targets:
            a = agg.get((w, top, t))
            if not a:
                continue
            row = [f"**{t}**" if t == KV else t]
            row += [fmt((agg.get((w, r, t)) or {}).get("ttft_p99_ms")) for r in rates[w]]
            row += [fmt((a["cache_hit"] or 0) * 100), fmt(a["throughput_rps"], digits=1), fmt(a["output_tps"]),
                    fmt(ratio(kvtop["ttft_p99_ms"], a["ttft_p99_ms"]) if kvtop else None, digits=2)]
            rows.append(row)
        L.append(f"### {WORKLOAD_TITLES.get(w, w)}\n")
        L.append(_md_table(header, rows))
        L.append("")

    # detail tables
    L.append("## All figures\n")
    for w in rates:
        L.append(f"### {WORKLOAD_TITLES.get(w, w)}\n")
        for r in rates[w]:
            rows = []
            for t in targets:
                a = agg.get((w, r, t))
                if not a:
                    continue
                rows.append([
                    t, fmt(a["ttft_p50_ms"], a["ttft_p50_ms_sd"]), fmt(a["ttft_p90_ms"]),
                    fmt(a["ttft_p99_ms"], a["ttft_p99_ms_sd"]), fmt(a["e2e_p50_ms"]), fmt(a["e2e_p99_ms"]),
                    fmt(a["itl_p50_ms"], digits=1), fmt(a["itl_p99_ms"], digits=1),
                    fmt(a["throughput_rps"], a["throughput_rps_sd"], digits=1), fmt(a["output_tps"]),
                    fmt((a["cache_hit"] or 0) * 100, (a["cache_hit_sd"] or 0) * 100),
                    fmt(a["spread_max_over_mean"], digits=2), fmt(a.get("affinity"), digits=2),
                    f"{a['errors']}/{a['requests']}",
                ])
            L.append(f"Offered {r:g} req/s:\n")
            L.append(_md_table(["target", "TTFT p50", "p90", "p99", "E2E p50", "p99", "ITL p50", "p99", "req/s",
                                "out tok/s", "hit %", "spread max/mean", "affinity", "errors/req"], rows))
            L.append("")
    L.append("*affinity*: for targets that name the serving worker (kvroute: `x-kvroute-worker`; bare Serve and the "
             "Ray prefix router: `x-bench-worker`), the share of a group's (shared prefix) or conversation's "
             "(multi-turn) requests that went to its most used worker; — where the target does not say.\n")

    # spread
    L.append("## Per-worker load (requests per worker, summed over repetitions, top rate, from /sim/stats)\n")
    for w in rates:
        top = rates[w][-1]
        rows = []
        for t in targets:
            a = agg.get((w, top, t))
            if a:
                pw = a["per_worker_requests"]
                rows.append([t] + [str(v) for v in pw.values()] + [fmt(a["spread_max_over_mean"], digits=2)])
        if rows:
            names = list(agg[(w, top, targets[0])]["per_worker_requests"]) if (w, top, targets[0]) in agg else []
            L.append(f"{WORKLOAD_TITLES.get(w, w)} @ {top:g} req/s:\n")
            L.append(_md_table(["target"] + names + ["max/mean"], rows))
            L.append("")

    # overhead
    if oh:
        L.append("## Router overhead (closed loop, tiny prompts, max_tokens=1)\n")
        ocfg = cfg["overhead"]
        reqs = ", ".join(f"{n} at concurrency {c}" for c, n in ocfg["requests"].items())
        L.append(f"{ocfg['reps']} repetitions; measured requests per (concurrency, target): {reqs}, after one "
                 "warm-up request per client; targets shuffled; closed loop (each client sends its next request when "
                 "the previous one ended); streamed chat, unique ~10-token prompt, `max_tokens` "
                 f"{ocfg['max_tokens']}. *added* = p50 end-to-end latency minus direct's at the same concurrency; "
                 "*÷ bare Serve* = added / bare Serve's added. At concurrency 16 and 64 the machine's two cores are "
                 "saturated (load generator, 4 simulated workers, Ray Serve), so these rows measure how much CPU "
                 "each path burns per request as much as its latency.\n")
        concs = sorted({c for c, _ in oh})
        for c in concs:
            d = oh.get((c, DIRECT))
            s = oh.get((c, SERVE))
            rows = []
            for t in targets:
                a = oh.get((c, t))
                if not a:
                    continue
                ok_d = d is not None and d["e2e_p50_ms"] is not None
                added = a["e2e_p50_ms"] - d["e2e_p50_ms"] if ok_d and a["e2e_p50_ms"] is not None else None
                add_s = s["e2e_p50_ms"] - d["e2e_p50_ms"] if ok_d and s and s["e2e_p50_ms"] is not None else None
                if t == DIRECT:
                    added = None
                rows.append([t, fmt(a["e2e_p50_ms"], a["e2e_p50_ms_sd"], digits=2), fmt(a["e2e_p99_ms"], digits=2),
                             fmt(added, digits=2), fmt(ratio(added, add_s) if added is not None and add_s and add_s > 0 else None, digits=2),
                             fmt(a["rps"]), f"{a['errors']}/{a['requests']}"])
            L.append(f"Concurrency {c}:\n")
            L.append(_md_table(["target", "e2e p50 ms", "e2e p99 ms", "added ms", "÷ bare Serve", "req/s", "errors/req"], rows))
            L.append("")

    # machine contention
    fc = [t["summary"].get("foreign_cores") for t in doc.get("trials", []) if t["summary"].get("foreign_cores") is not None]
    bc = [t["summary"].get("bench_cores") for t in doc.get("trials", []) if t["summary"].get("bench_cores") is not None]
    if fc:
        busy = sum(1 for x in fc if x > 0.5)
        L.append("## CPU during the trials\n")
        L.append(f"This run (load generator, Ray, routers, simulated workers) used on average {statistics.fmean(bc):.2f} "
                 f"cores during trials (max {max(bc):.2f}) of the machine's {doc['machine'].get('cores')}. Other jobs on "
                 f"the machine used on average {statistics.fmean(fc):.2f} cores (max {max(fc):.2f}); {busy} of "
                 f"{len(fc)} trials ran while other jobs used more than half a core. Per-trial figures are in the JSON "
                 f"(`trials[].summary.cpu`). Targets were interleaved so that such interference spreads over all of "
                 f"them, but a trial that coincided with a burst of foreign load is slower than its neighbours.\n")
        rows = []
        for t in targets:
            f = [x["summary"]["foreign_cores"] for x in doc["trials"] if x["target"] == t and x["summary"].get("foreign_cores") is not None]
            b = [x["summary"]["bench_cores"] for x in doc["trials"] if x["target"] == t and x["summary"].get("bench_cores") is not None]
            if f:
                rows.append([t, f"{statistics.fmean(b):.2f}", f"{max(b):.2f}", f"{statistics.fmean(f):.2f}", f"{max(f):.2f}"])
        L.append(_md_table(["target", "this run, mean cores", "max", "other jobs, mean cores", "max"], rows))
        L.append("")

    L.extend(_pooled_section(doc, targets))
    L.extend(_cpu_per_request(doc, targets))

    # kvroute diagnostics
    kv_trials = [t for t in doc.get("trials", []) if t["summary"].get("stale_view_before_poke") is not None]
    if kv_trials:
        stale = [t for t in kv_trials if t["summary"]["stale_view_before_poke"]]
        ws = [w for t in stale for w in t["summary"]["stale_view_before_poke"]]
        L.append("## kvroute: what its routers believed between trials\n")
        L.append(f"Before every kvroute trial (after the previous target's trial had fully drained, before the flush "
                 f"and the poke) the harness compared each kvroute router's `/workers` view with the engines' own "
                 f"`/sim/stats`. In {len(stale)} of {len(kv_trials)} kvroute trials the router showed at least one "
                 f"worker `live` with running/waiting requests or KV in use while that engine was idle "
                 f"({len(ws)} worker views in all"
                 + (f"; reported running up to {max(w['reported_running'] or 0 for w in ws)}, KV in use up to "
                    f"{max(w['reported_kv_active'] or 0 for w in ws)} blocks, last report up to "
                    f"{max(w['metrics_age_s'] or 0 for w in ws):.2f} s old" if ws else "")
                 + "). SGLang (and the simulator) report only at prefill batches and every 40 decode steps, and "
                 "not at all when idle: requests that finish after the last report stay in the router's view "
                 "until the worker reports again or is declared idle (`idle_after_s`). The harness therefore "
                 "pokes every worker directly after the flush so that all routers start each trial from fresh "
                 "reports.\n")
        rows = []
        for t in stale[:8]:
            for w in t["summary"]["stale_view_before_poke"][:2]:
                rows.append([t["target"], t["workload"], f"{t['rate']:g}", w["worker"], str(w["reported_running"]),
                             str(w["reported_waiting"]), str(w["reported_kv_active"]), f"{w['metrics_age_s']:.2f}",
                             f"{w['engine_running']}/{w['engine_waiting']}"])
        if rows:
            L.append("Examples:\n")
            L.append(_md_table(["router", "workload", "rate", "worker", "reported running", "waiting", "KV blocks",
                                "report age s", "engine running/waiting"], rows))
            L.append("")

    # plots
    if plots:
        L.append("## Plots\n")
        for p in plots:
            L.append(f"![{p}]({p})")
        L.append("")

    # sub-benchmarks
    subs = doc.get("sub_benchmarks") or {}
    for key, title in (("ingest", "Ingest and freshness (bench.ingest)"), ("decision", "Decision cost (bench/decision.py)")):
        s = subs.get(key)
        if not s:
            continue
        L.append(f"## {title}\n")
        L.append(f"Run as a subprocess in this run: `{s['command']}` ({s['seconds']} s, exit {s['returncode']}).\n")
        body = s["stdout"].strip()
        # demote the script's own headings below ours
        body = "\n".join(("###" + line.lstrip("#")) if line.startswith("#") else line for line in body.splitlines())
        L.append(body or "(no output)")
        if s.get("stderr"):
            L.append("\n```\n" + s["stderr"].strip()[-1500:] + "\n```")
        L.append("")
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------ plots


def _plots(doc, agg, rates, targets, oh, out_dir: Path, stem: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    palette = list(plt.cm.tab10.colors) + ["black", "goldenrod", "navy", "lime"]
    styles = {t: dict(color=palette[i % len(palette)], marker="os^vD<>ph*PX"[i % 12],
                      lw=2.5 if t == KV else 1.2, ls="-" if not t.startswith("sglang") else "--")
              for i, t in enumerate(TARGET_ORDER + [t for t in targets if t not in TARGET_ORDER])}
    ws = list(rates)
    if ws:
        fig, axes = plt.subplots(2, len(ws), figsize=(5.2 * len(ws), 8), squeeze=False)
        for j, w in enumerate(ws):
            for i, (metric, title) in enumerate((("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"))):
                ax = axes[i][j]
                for t in targets:
                    xs = [r for r in rates[w] if (w, r, t) in agg and agg[(w, r, t)][metric] is not None]
                    ys = [agg[(w, r, t)][metric] for r in xs]
                    es = [agg[(w, r, t)][metric + "_sd"] or 0 for r in xs]
                    if xs:
                        ax.errorbar(xs, ys, yerr=es, label=t, capsize=2, **styles[t])
                ax.set_yscale("log")
                ax.set_title(f"{WORKLOAD_TITLES.get(w, w)} — {title}")
                ax.set_xlabel("offered load (req/s)")
                ax.set_ylabel("ms")
                ax.grid(alpha=0.3, which="both")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        f = f"{stem}-ttft.png"
        fig.savefig(out_dir / f, dpi=90)
        plt.close(fig)
        files.append(f)

        fig, axes = plt.subplots(1, len(ws), figsize=(5.2 * len(ws), 4), squeeze=False)
        for j, w in enumerate(ws):
            ax = axes[0][j]
            for t in targets:
                xs = [r for r in rates[w] if (w, r, t) in agg]
                ys = [agg[(w, r, t)]["throughput_rps"] for r in xs]
                if xs:
                    ax.plot(xs, ys, label=t, **styles[t])
            lim = max(rates[w])
            ax.plot([0, lim], [0, lim], color="grey", lw=0.8, ls=":")
            ax.set_title(f"{WORKLOAD_TITLES.get(w, w)} — throughput")
            ax.set_xlabel("offered (req/s)")
            ax.set_ylabel("completed (req/s)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        f = f"{stem}-throughput.png"
        fig.savefig(out_dir / f, dpi=90)
        plt.close(fig)
        files.append(f)

        fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(ws) * len(targets) / 3), 4.5))
        width = 0.8 / max(1, len(targets))
        for i, t in enumerate(targets):
            vals = []
            for w in ws:
                hs = [agg[(w, r, t)]["cache_hit"] for r in rates[w] if (w, r, t) in agg and agg[(w, r, t)]["cache_hit"] is not None]
                vals.append(100 * statistics.fmean(hs) if hs else 0)
            ax.bar([j + i * width for j in range(len(ws))], vals, width, label=t, color=styles[t]["color"],
                   edgecolor="black" if t == KV else None)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ws))])
        ax.set_xticklabels([WORKLOAD_TITLES.get(w, w) for w in ws])
        ax.set_ylabel("engine cache hit % (mean over rates)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        f = f"{stem}-cache-hit.png"
        fig.savefig(out_dir / f, dpi=90)
        plt.close(fig)
        files.append(f)

    if oh:
        concs = sorted({c for c, _ in oh})
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for t in targets:
            xs = [c for c in concs if (c, t) in oh]
            if not xs:
                continue
            xs = [c for c in xs if oh[(c, t)]["e2e_p50_ms"] is not None]
            axes[0].plot(xs, [oh[(c, t)]["e2e_p50_ms"] for c in xs], label=t, **styles[t])
            if t != DIRECT:
                pts = [(c, oh[(c, t)]["e2e_p50_ms"] - oh[(c, DIRECT)]["e2e_p50_ms"]) for c in xs
                       if (c, DIRECT) in oh and None not in (oh[(c, t)]["e2e_p50_ms"], oh[(c, DIRECT)]["e2e_p50_ms"])]
                if pts:
                    axes[1].plot([p[0] for p in pts], [p[1] for p in pts], label=t, **styles[t])
        for ax, title in zip(axes, ("p50 end-to-end latency (ms)", "added vs direct (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs)
            ax.set_xticklabels([str(c) for c in concs])
            ax.set_xlabel("concurrency")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        f = f"{stem}-overhead.png"
        fig.savefig(out_dir / f, dpi=90)
        plt.close(fig)
        files.append(f)
    return files


def main(argv: list[str] | None = None) -> int:
    """Re-render a results JSON (e.g. after adding notes): python -m bench.render bench/results/quick.json"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.render", description=main.__doc__)
    ap.add_argument("json", help="a results JSON written by bench.run")
    ap.add_argument("--notes", help="Markdown file with a reading of this run, included in the report")
    ns = ap.parse_args(argv)
    path = Path(ns.json)
    doc = json.loads(path.read_text())
    for key in ("aggregate", "overhead_aggregate", "goals", "plots"):
        doc.pop(key, None)
    if ns.notes:
        doc["notes"] = Path(ns.notes).read_text()
    render(doc, path.parent, path.stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
