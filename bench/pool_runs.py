"""Pool the measured requests of several `bench.run` results (same suite, different seeds or hours)
and give kv_aware's TTFT and end-to-end ratios against every other target with bootstrap intervals.

    python -m bench.pool_runs bench/results/pd-30s.json bench/results/pd-30s-2.json

One run's pooled tails (its "Pooled tails" section) rest on its own repetitions only; a goal whose
interval straddles its bound there may be settled by more repetitions — runs made with other seeds
(other traces) are independent samples of the same cells. Within each run every target ran the same
traces interleaved, so a run on a busier machine slows all targets alike; the pooled percentiles mix
the runs' conditions, which is why each repetition's own ratios are printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.report import bootstrap_ci, pooled, ratio_ci  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench.run JSON files")
    ap.add_argument("--subject", default="kvroute-kv_aware", help="the target whose ratios are given")
    ns = ap.parse_args(argv)
    runs = [(Path(p).name, json.loads(Path(p).read_text())) for p in ns.results]
    trials = [dict(t, run=name) for name, doc in runs for t in doc["trials"]]
    groups = pooled(trials, ("workload", "rate", "target"))
    cells = sorted({(w, r) for w, r, _ in groups})
    for workload, rate in cells:
        subject = groups.get((workload, rate, ns.subject))
        if subject is None:
            continue
        p99 = bootstrap_ci(subject["ttft"], 99)
        print(f"\n{workload} @ {rate:g} req/s: {ns.subject} {subject['reps']} repetitions, {len(subject['ttft'])} "
              f"requests, TTFT p99 {p99[0]:,.0f} ms, {subject['rps']:.2f} req/s")
        print("| target | requests | TTFT p99 ms | TTFT p99 ratio [95 % CI] | TTFT p50 ratio | E2E p99 ratio | "
              "E2E p50 ratio | throughput ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for (w, r, target), g in sorted(groups.items()):
            if (w, r) != (workload, rate) or target == ns.subject:
                continue
            ratios = [_ratio(subject[m], g[m], q) for m in ("ttft", "e2e") for q in (99, 50)]
            print(f"| {target} | {len(g['ttft'])} | {bootstrap_ci(g['ttft'], 99)[0]:,.0f} | " + " | ".join(ratios)
                  + f" | {subject['rps'] / g['rps']:.2f} |")
        print(f"\nper repetition ({ns.subject}'s TTFT p50 / p99, E2E p50 / p99 ÷ each target's):")
        for name, doc in runs:
            for rep in sorted({t["rep"] for t in doc["trials"]}):
                cell = {t["target"]: t["summary"] for t in doc["trials"]
                        if t["rep"] == rep and t["workload"] == workload and t["rate"] == rate}
                s = cell.get(ns.subject)
                if s is None:
                    continue
                parts = [f"{t} " + " / ".join(_div(s, o, k) for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms",
                                                                        "e2e_p99_ms"))
                         for t, o in sorted(cell.items()) if t != ns.subject]
                print(f"- {name} rep {rep} (other jobs {s.get('foreign_cores', 0):.2f} cores): " + "; ".join(parts))
    return 0


def _div(s: dict, o: dict, key: str) -> str:
    a, b = s.get(key), o.get(key)
    return "—" if not a or not b else f"{a / b:.2f}"


def _ratio(num: list[float], den: list[float], q: float) -> str:
    """percentile_q(num) / percentile_q(den) [95 % CI], or — when either side has too few values."""
    r = ratio_ci(num, den, q)
    return "—" if r is None else f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]"


if __name__ == "__main__":
    raise SystemExit(main())
