"""Where each target's time goes, from a `bench.run --dump` directory (or a .tgz of one).

    python -m bench.dump_phases bench/results/dynamo-mooncake-2-dump.tgz

Per workload × target, over the measured requests (sent after the warm-up) of every repetition:

- the decode phase (E2E − TTFT) fitted as `a + b·output tokens`, and the median decode phase of short
  (≤ 16 tokens), medium and long (> 64) replies: a relay that holds the end of a stream shows in `a`;
- co-decoding: for each request, the mean number of other requests decoding on its worker while it
  decoded (from the worker header and the client's times; targets that name no worker: —);
- prefill pauses: the uncached prompt tokens of the other requests on its worker whose first token
  came while it decoded (SGLang runs their prefill instead of its decode steps), their mean, and the
  decode phase refitted as `a' + b'·output tokens + c·those tokens` — `c` near the engine's prefill
  time per token and `a'` near zero say the decode phase's excess is those pauses, not the relay;
- the TTFT tail's composition: prompt size (and uncached part) of the requests at or above the p99,
  and TTFT p50 / p99 of prompts ≥ 2k tokens and < 2k tokens;
- for `dynamo-*` targets with a decisions file: the selection call's wall time (p50 / p90 / p99 ms)
  and the share of prompt tokens the service believed cached where it sent them.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import numpy as np

_ROWS = re.compile(r"^(?P<w>[a-z_]+)-(?P<rate>[\d.]+)-(?P<target>.+)-rep(?P<rep>\d+)\.jsonl$")
_DECISIONS = re.compile(r"^decisions-(?P<target>.+)\.jsonl$")


def _files(src: Path) -> Iterator[tuple[str, str]]:
    if src.is_dir():
        for p in sorted(src.iterdir()):
            yield p.name, p.read_text()
        return
    with tarfile.open(src) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            if m.isfile():
                yield Path(m.name).name, io.TextIOWrapper(tf.extractfile(m), "utf-8").read()  # type: ignore[arg-type]


def load(src: Path, warmup_s: float) -> tuple[dict, dict]:
    rows: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    decisions: dict[str, list[dict[str, Any]]] = {}
    for name, text in _files(src):
        if (m := _ROWS.match(name)):
            rows[(m["w"], m["target"])][m["rep"]] = [json.loads(line) for line in text.splitlines() if line]
        elif (m := _DECISIONS.match(name)) and m["target"].startswith("dynamo-"):
            decisions[m["target"]] = [json.loads(line) for line in text.splitlines() if line]
    return rows, decisions


def _p(v: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(v, q)) if len(v) else float("nan")


def report(rows: dict, decisions: dict, warmup_s: float) -> str:
    L = ["| workload | target | decode a ms | b ms/token | decode ≤16 / 17–64 / >64 tokens, median ms | "
         "co-decoding p50 / p90 | paused by prefill tokens, mean | a' ms / b' ms/token / c µs per token | TTFT p99 | p99 requests' prompt (uncached) | ≥ 2k tokens TTFT p50 / p99 | "
         "< 2k p50 / p99 |", "|---|---|---:|---:|---|---|---:|---|---:|---|---|---|"]
    for (w, t), reps in sorted(rows.items()):
        ok = [r for rs in reps.values() for r in rs if r["ok"] and r["sent_s"] >= warmup_s]
        dec = [r for r in ok if r["tokens"] > 1]
        x = np.array([r["tokens"] for r in dec], float)
        y = np.array([r["e2e_ms"] - r["ttft_ms"] for r in dec])
        b, a = np.polyfit(x, y, 1) if len(x) > 1 else (float("nan"), float("nan"))
        bands = " / ".join(f"{_p(y[m], 50):.0f}" for m in (x <= 16, (x > 16) & (x <= 64), x > 64))
        co: list[float] = []
        fit: list[tuple[float, float, float]] = []  # (output tokens, prefill tokens pausing it, decode ms)
        if any(r["worker"] for r in ok):
            for rs in reps.values():
                done = [r for r in rs if r["ok"]]
                by_worker: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
                for r in done:
                    s = r["sent_s"]
                    by_worker[r["worker"]].append((s + r["ttft_ms"] / 1e3, s + r["e2e_ms"] / 1e3,
                                                   r["prompt_tokens"] - (r["cached_tokens"] or 0)))
                for r in done:
                    if r["sent_s"] < warmup_s or r["tokens"] < 2:
                        continue
                    f, e = r["sent_s"] + r["ttft_ms"] / 1e3, r["sent_s"] + r["e2e_ms"] / 1e3
                    others = by_worker[r["worker"]]
                    co.append(sum(max(0.0, min(e, oe) - max(f, of)) for of, oe, _ in others) / (e - f) - 1)
                    fit.append((r["tokens"], sum(u for of, _, u in others if f < of < e), r["e2e_ms"] - r["ttft_ms"]))
        pauses = "— | —"
        if len(fit) > 3:
            X = np.array([(1.0, n, u) for n, u, _ in fit])
            (a2, b2, c2), *_ = np.linalg.lstsq(X, np.array([d for *_, d in fit]), rcond=None)
            pauses = f"{X[:, 2].mean():,.0f} | {a2:.0f} / {b2:.2f} / {c2 * 1e3:.0f}"
        ttft = [r["ttft_ms"] for r in ok]
        p99 = _p(ttft, 99)
        tail = [r for r in ok if r["ttft_ms"] >= p99]
        big = [r["ttft_ms"] for r in ok if r["prompt_tokens"] >= 2048]
        small = [r["ttft_ms"] for r in ok if r["prompt_tokens"] < 2048]
        L.append(f"| {w} | {t} | {a:.0f} | {b:.2f} | {bands} | "
                 + (f"{_p(co, 50):.1f} / {_p(co, 90):.1f}" if co else "—")
                 + f" | {pauses} | {p99:,.0f} | {_p([r['prompt_tokens'] for r in tail], 50):,.0f} "
                 f"({_p([r['prompt_tokens'] - (r['cached_tokens'] or 0) for r in tail], 50):,.0f}) | "
                 f"{_p(big, 50):,.0f} / {_p(big, 99):,.0f} | {_p(small, 50):,.0f} / {_p(small, 99):,.0f} |")
    if decisions:
        L += ["", "| Dynamo target | selections | select_and_reserve ms p50 / p90 / p99 | believed cached (tokens) |",
              "|---|---:|---|---:|"]
        for t, ds in sorted(decisions.items()):
            ms = [d["decide_ms"] for d in ds]
            share = sum(d["overlap_tokens"] for d in ds) / max(1, sum(d["prompt_tokens"] for d in ds))
            L.append(f"| {t} | {len(ds)} | {_p(ms, 50):.1f} / {_p(ms, 90):.1f} / {_p(ms, 99):.1f} | {share * 100:.1f} % |")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dump_phases", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a --dump directory or a .tgz of its files")
    ap.add_argument("--warmup", type=float, default=5.0, help="requests sent earlier are not measured (the suite's)")
    ns = ap.parse_args(argv)
    rows, decisions = load(Path(ns.src), ns.warmup)
    print(report(rows, decisions, ns.warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
