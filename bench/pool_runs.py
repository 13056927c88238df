"""Pool the measured requests of several `bench.run` results (same suite, different seeds or hours)
and give kv_aware's TTFT ratios against every other target with bootstrap intervals.

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
        print("| target | requests | TTFT p99 ms | p99 ratio [95 % CI] | p50 ratio [95 % CI] | throughput ratio |")
        print("|---|---:|---:|---:|---:|---:|")
        for (w, r, target), g in sorted(groups.items()):
            if (w, r) != (workload, rate) or target == ns.subject:
                continue
            q99, q50 = ratio_ci(subject["ttft"], g["ttft"], 99), ratio_ci(subject["ttft"], g["ttft"], 50)
            print(f"| {target} | {len(g['ttft'])} | {bootstrap_ci(g['ttft'], 99)[0]:,.0f} | "
                  f"{q99[0]:.2f} [{q99[1]:.2f}, {q99[2]:.2f}] | {q50[0]:.2f} [{q50[1]:.2f}, {q50[2]:.2f}] | "
                  f"{subject['rps'] / g['rps']:.2f} |")
        print(f"\nper repetition ({ns.subject}'s TTFT p50 / p99 ÷ each target's):")
        for name, doc in runs:
            for rep in sorted({t["rep"] for t in doc["trials"]}):
                cell = {t["target"]: t["summary"] for t in doc["trials"]
                        if t["rep"] == rep and t["workload"] == workload and t["rate"] == rate}
                s = cell.get(ns.subject)
                if s is None:
                    continue
                parts = [f"{t} {s['ttft_p50_ms'] / o['ttft_p50_ms']:.2f} / {s['ttft_p99_ms'] / o['ttft_p99_ms']:.2f}"
                         for t, o in sorted(cell.items()) if t != ns.subject]
                print(f"- {name} rep {rep} (other jobs {s.get('foreign_cores', 0):.2f} cores): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
