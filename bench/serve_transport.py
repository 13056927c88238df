"""Ray Serve transport: CPU per request of the proxy → router replica hop, actor calls vs gRPC.

    python -m bench.serve_transport [--rounds 2] [--requests 200] [--concurrency 8]

Each round starts, per transport, a fresh local Ray (in a child process: Serve reads the settings
of `serve_app.ray_env` from the environment when its processes start) with 4 simulated workers and
kvroute's router, plus a bare Serve pass-through (`bench.targets.PassThrough`, Serve's own floor),
then drives the same closed-loop load at each: streamed chat (`max_tokens` 1, 12 and 48) and
non-streamed. Per request it reports the CPU time used by Serve's HTTP proxy and by the replica
(from /proc, all threads), the throughput and the e2e p50. Transports alternate within a round;
figures are medians over rounds, and the last columns are the gRPC/actor ratios of the same row.
Loopback only; each child is bounded by a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "actor": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0", "RAY_SERVE_PROXY_USE_GRPC": "0"},
    "grpc": {},  # serve_app.ray_env.SERVE_ENV, as kvroute runs
}
CASES = [(False, 12), (True, 1), (True, 12), (True, 48)]  # (stream, max_tokens)


def _label(p: Any) -> str:
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except Exception:
        return ""
    if "ProxyActor" in text:
        return "proxy"
    if "ServeReplica:" in text:
        return "replica:" + text.split("ServeReplica:", 1)[1].split()[0]
    return ""


def _cpu() -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter():
        lab = _label(p)
        if lab:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            out[lab] = out.get(lab, 0.0) + t.user + t.system
    return out


async def _drive(url: str, n: int, conc: int, stream: bool, max_tokens: int) -> list[float]:
    import httpx

    sem = asyncio.Semaphore(conc)
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=httpx.Limits(max_connections=conc)) as c:
        async def one(i: int) -> None:
            body = {"model": "m", "max_tokens": max_tokens, "stream": stream,
                    "messages": [{"role": "user", "content": f"question {i}: " + "tell me more " * 20}]}
            async with sem:
                t = time.perf_counter()
                if stream:
                    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        async for _ in r.aiter_raw():
                            pass
                else:
                    r = await c.post(url + "/v1/chat/completions", json=body)
                    r.raise_for_status()
                lat.append(time.perf_counter() - t)
        await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def _child(requests: int, conc: int) -> list[dict[str, Any]]:
    from bench.run import ENGINE
    from bench.targets import BenchFleet

    fleet = BenchFleet(workers=4, engine_args=ENGINE, targets_enabled=("kvroute-kv_aware", "serve-random"),
                       progress=lambda *a: None)
    targets = fleet.start()
    rows = []
    try:
        for t in targets:
            replica = "replica:kvroute" if t.name.startswith("kvroute") else "replica:serve-random"
            for stream, mt in CASES:
                await _drive(t.urls[0], 2 * conc, conc, stream, mt)  # warm connections
                a = _cpu()
                t0 = time.monotonic()
                lat = await _drive(t.urls[0], requests, conc, stream, mt)
                wall = time.monotonic() - t0
                b = _cpu()
                used = {k: b[k] - a.get(k, 0.0) for k in b}
                rep = sum(v for k, v in used.items() if k.startswith(replica))
                rows.append({"target": t.name, "stream": stream, "max_tokens": mt,
                             "proxy_ms": used.get("proxy", 0.0) / requests * 1e3,
                             "replica_ms": rep / requests * 1e3, "req_s": requests / wall,
                             "e2e_p50_ms": statistics.median(lat) * 1e3})
    finally:
        fleet.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args.requests, args.concurrency))))
        return

    from serve_app.ray_env import SERVE_ENV

    results: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else list(MODES)[::-1]):
            env = {**os.environ, **SERVE_ENV, **MODES[mode], "RAY_USAGE_STATS_ENABLED": "0"}
            out = subprocess.run([sys.executable, "-m", "bench.serve_transport", "--child", mode,
                                  "--requests", str(args.requests), "--concurrency", str(args.concurrency)],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                sys.exit(f"{mode} round {r} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {mode} done", file=sys.stderr, flush=True)

    def med(mode: str, i: int, key: str) -> float:
        return statistics.median(run[i][key] for run in results[mode])

    print("# Ray Serve transport — proxy → replica as Ray actor calls vs gRPC\n")
    print(f"command: `python -m bench.serve_transport {' '.join(sys.argv[1:])}`  ")
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.rounds} round(s), {args.requests} requests per row at concurrency {args.concurrency}; "
          "medians over rounds\n")
    print("| target | request | transport | proxy CPU ms/req | replica CPU ms/req | proxy+replica | req/s | "
          "e2e p50 ms | gRPC ÷ actor (proxy+replica) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for i, row in enumerate(results["actor"][0]):
        what = f"{'stream' if row['stream'] else 'non-stream'}, max_tokens {row['max_tokens']}"
        both = {m: med(m, i, "proxy_ms") + med(m, i, "replica_ms") for m in MODES}
        for m in MODES:
            ratio = f"{both['grpc'] / both['actor']:.2f}" if m == "grpc" else ""
            print(f"| {row['target']} | {what} | {m} | {med(m, i, 'proxy_ms'):.2f} | {med(m, i, 'replica_ms'):.2f} | "
                  f"{both[m]:.2f} | {med(m, i, 'req_s'):.1f} | {med(m, i, 'e2e_p50_ms'):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
