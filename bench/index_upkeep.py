"""The approximate prefix index's per-request cost on the Mooncake replay, outside any server.

Run: python -m bench.index_upkeep [--passes 4] [--rounds 3] [--workers 4]

What the router replica does per streamed request with the index, in the bench's standard
Mooncake cell (20 req/s, lengths ×1/8, the block hashes `RouterCore.facts` makes of the chat
body): `overlap` of the prompt, `take_changed`, `record` on the chosen worker (round-robin), at
the trace's own arrival times. Pass k replays the same 1,200 arrivals with the text of seed k
(disjoint blocks) `60 s × k` later, so from the third pass on every new block pushes an expired
one out (`ttl_s` 120 s): "trial" is the first pass (what a 60 s bench trial sees), "steady" the
passes after 120 s (a long-running replica: expiry included), with the replica's GC
thresholds (`router.gc_thresholds`). Prints µs per request, median of
`--rounds` rounds, and the process's resident index size. Compare two versions of the code by
running it with each on PYTHONPATH, alternately.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import build_messages, mooncake  # noqa: E402
from serve_app.config import RouterConfig  # noqa: E402
from serve_app.prefix_index import PrefixIndex  # noqa: E402
from serve_app.request_facts import facts_from_body  # noqa: E402


def prompts(seed: int) -> list[tuple[float, tuple[int, ...]]]:
    """(arrival s, block hashes) of the standard cell's 1,200 requests with seed `seed`'s text."""
    tr = mooncake(seed, 20, 60.0, length_scale=0.125)
    out = []
    for s in tr.sessions:
        body = {"model": "default", "messages": build_messages(s, 0, []), "max_tokens": 1, "stream": True}
        out.append((s.start_s, facts_from_body(body).block_hashes))
    return out


def replay(passes: list[list[tuple[float, tuple[int, ...]]]], workers: list[str]) -> dict[str, list[int]]:
    t = [0.0]
    ix = PrefixIndex(clock=lambda: t[0])
    ns: dict[str, list[int]] = {"trial": [], "steady": []}
    pc = time.perf_counter_ns
    i = 0
    for k, arrivals in enumerate(passes):
        phase = "trial" if k == 0 else "steady" if 60.0 * k >= 120.0 else None
        for at, hashes in arrivals:
            t[0] = 60.0 * k + at
            w = workers[i % len(workers)]
            i += 1
            t0 = pc()
            ix.overlap(hashes)
            ix.take_changed()
            ix.record(w, hashes)
            dt = pc() - t0
            if phase is not None:
                ns[phase].append(dt)
    ns["entries"] = [len(ix)]
    return ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    passes = [prompts(1 + k) for k in range(a.passes)]
    thresholds = RouterConfig().gc_thresholds
    if thresholds is not None:  # as in the router replica
        gc.set_threshold(*thresholds)
    blocks = [len(h) for _, h in passes[0]]
    workers = [f"sim-{i}" for i in range(a.workers)]
    res: dict[str, list[float]] = {"trial": [], "steady": []}
    for _ in range(a.rounds):
        gc.collect()
        ns = replay(passes, workers)
        for k in res:
            if ns[k]:
                res[k].append(sum(ns[k]) / len(ns[k]) / 1e3)
    print(f"{len(passes[0])} requests per pass, {statistics.mean(blocks):.0f} blocks per prompt, "
          f"{a.passes} passes, {ns['entries'][0]} entries at the end")
    for k, v in res.items():
        if v:
            print(f"{k:>7}: overlap + take_changed + record, mean per request {statistics.median(v):7.1f} µs "
                  f"(rounds: {', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    main()
