"""Ray Serve hop: CPU per request of the proxy → router replica path, across transports or relay batching.

    python -m bench.serve_transport [--compare transport|batching] [--rounds 2] [--requests 200] [--concurrency 8]

`--compare transport` (default): Serve's ingress and its hop to the replica — the Python HTTP proxy
calling the replica with Ray actor calls (Ray's default), the same over gRPC, and HAProxy in front
of the replica's own HTTP server (kvroute's `serve_app.ray_env`). The "proxy" columns count every
ingress process: Serve's proxy actor, and with HAProxy also `haproxy` and Ray's HAProxy manager.
`--compare batching`: kvroute's transport, kvroute's `stream_batching_interval_ms` at each of `--batching-ms`
(default 0,20,50): 0 relays every upstream read as its own Serve message, more batches them.

Each round starts, per variant, a fresh local Ray (in a child process: Serve reads the settings
of `serve_app.ray_env` from the environment when its processes start) with 4 simulated workers and
kvroute's router, plus a bare Serve pass-through (`bench.targets.PassThrough`, Serve's own floor,
relaying with the same batching), then drives the same closed-loop load at each: streamed chat
(`max_tokens` 1, 12 and 48) and non-streamed. Per request it reports the CPU time used by Serve's
ingress (proxy processes) and by the replica (from /proc, all threads), the throughput, the e2e p50 and, for
streams, the client's TTFT p50 and how many body reads it needed per reply. Variants alternate
within a round; figures are medians over rounds, and the last column is the ratio of the row's
proxy+replica CPU to the first variant's. Loopback only; each child is bounded by a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRANSPORTS = {
    # Serve's Python HTTP proxy calling the replica with Ray actor calls (Ray's default)
    "actor": {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0", "RAY_SERVE_PROXY_USE_GRPC": "0"},
    # the same proxy over gRPC
    "grpc": {"RAY_SERVE_ENABLE_HA_PROXY": "0"},
    # HAProxy on the HTTP port → each replica's own HTTP server (direct ingress): serve_app.ray_env, as kvroute runs
    "haproxy": {},
}


def variants(compare: str, batching_ms: list[float]) -> dict[str, tuple[dict[str, str], dict[str, Any]]]:
    """name → (environment overrides, router args) per variant; the first is the ratio's base."""
    if compare == "transport":
        return {name: (env, {}) for name, env in TRANSPORTS.items()}
    return {f"batch {ms:g} ms": ({}, {"stream_batching_interval_ms": ms}) for ms in batching_ms}
_TEXT = re.compile(rb'"content":\s*"[^"]')
CASES = [(False, 12), (True, 1), (True, 12), (True, 48)]  # (stream, max_tokens)


def _label(p: Any) -> str:
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except Exception:
        return ""
    if "ProxyActor" in text or "HAProxyManager" in text or text.startswith("haproxy "):
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


async def _drive(url: str, n: int, conc: int, stream: bool, max_tokens: int) -> dict[str, list[float]]:
    import httpx

    sem = asyncio.Semaphore(conc)
    out: dict[str, list[float]] = {"lat": [], "ttft": [], "reads": []}
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=httpx.Limits(max_connections=conc)) as c:
        async def one(i: int) -> None:
            body = {"model": "m", "max_tokens": max_tokens, "stream": stream,
                    "messages": [{"role": "user", "content": f"question {i}: " + "tell me more " * 20}]}
            async with sem:
                t = time.perf_counter()
                if stream:
                    reads, seen = 0, False
                    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        async for data in r.aiter_raw():
                            if not seen and _TEXT.search(data):  # first token's text, not the role chunk
                                out["ttft"].append(time.perf_counter() - t)
                                seen = True
                            reads += 1
                    out["reads"].append(reads)
                else:
                    r = await c.post(url + "/v1/chat/completions", json=body)
                    r.raise_for_status()
                out["lat"].append(time.perf_counter() - t)
        await asyncio.gather(*(one(i) for i in range(n)))
    return out


async def _child(requests: int, conc: int, router_args: dict[str, Any]) -> list[dict[str, Any]]:
    from bench.run import ENGINE
    from bench.targets import BenchFleet

    fleet = BenchFleet(workers=4, engine_args=ENGINE, targets_enabled=("kvroute-kv_aware", "serve-random"),
                       progress=lambda *a: None, router_args=router_args)
    targets = fleet.start()
    rows = []
    try:
        for t in targets:
            replica = "replica:kvroute" if t.name.startswith("kvroute") else "replica:serve-random"
            for stream, mt in CASES:
                await _drive(t.urls[0], 2 * conc, conc, stream, mt)  # warm connections
                a = _cpu()
                t0 = time.monotonic()
                got = await _drive(t.urls[0], requests, conc, stream, mt)
                wall = time.monotonic() - t0
                b = _cpu()
                used = {k: b[k] - a.get(k, 0.0) for k in b}
                rep = sum(v for k, v in used.items() if k.startswith(replica))
                rows.append({"target": t.name, "stream": stream, "max_tokens": mt,
                             "proxy_ms": used.get("proxy", 0.0) / requests * 1e3,
                             "replica_ms": rep / requests * 1e3, "req_s": requests / wall,
                             "e2e_p50_ms": statistics.median(got["lat"]) * 1e3,
                             "ttft_p50_ms": statistics.median(got["ttft"]) * 1e3 if got["ttft"] else None,
                             "reads": statistics.mean(got["reads"]) if got["reads"] else None})
    finally:
        fleet.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=("transport", "batching"), default="transport")
    ap.add_argument("--batching-ms", default="0,20,50", help="with --compare batching: intervals to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # JSON router args
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(asyncio.run(_child(args.requests, args.concurrency, json.loads(args.child)))))
        return

    from serve_app.ray_env import SERVE_ENV

    vs = variants(args.compare, [float(x) for x in args.batching_ms.split(",") if x.strip()])
    names = list(vs)
    results: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in vs}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            env_over, router_args = vs[name]
            env = {**os.environ, **SERVE_ENV, **env_over, "RAY_USAGE_STATS_ENABLED": "0"}
            out = subprocess.run([sys.executable, "-m", "bench.serve_transport", "--child", json.dumps(router_args),
                                  "--requests", str(args.requests), "--concurrency", str(args.concurrency)],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                sys.exit(f"{name} round {r} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {name} done", file=sys.stderr, flush=True)

    def med(name: str, i: int, key: str) -> float | None:
        vals = [run[i][key] for run in results[name] if run[i].get(key) is not None]
        return statistics.median(vals) if vals else None

    def f(x: float | None, d: int = 2) -> str:
        return "" if x is None else f"{x:.{d}f}"

    what_cmp = ("Python proxy (actor calls, gRPC) vs HAProxy ingress" if args.compare == "transport"
                else "relay batching intervals")
    print(f"# Ray Serve ingress — CPU per request of ingress + router replica: {what_cmp}\n")
    print(f"command: `python -m bench.serve_transport {' '.join(sys.argv[1:])}`  ")
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.rounds} round(s), {args.requests} requests per row at concurrency {args.concurrency}; "
          "medians over rounds; client reads = body reads per streamed reply as the client saw them\n")
    print("| target | request | variant | proxy CPU ms/req | replica CPU ms/req | proxy+replica | req/s | "
          f"e2e p50 ms | TTFT p50 ms | client reads | ÷ {names[0]} (proxy+replica) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, row in enumerate(results[names[0]][0]):
        what = f"{'stream' if row['stream'] else 'non-stream'}, max_tokens {row['max_tokens']}"
        both = {m: (med(m, i, "proxy_ms") or 0.0) + (med(m, i, "replica_ms") or 0.0) for m in names}
        for m in names:
            ratio = f"{both[m] / both[names[0]]:.2f}" if m != names[0] and both[names[0]] else ""
            print(f"| {row['target']} | {what} | {m} | {f(med(m, i, 'proxy_ms'))} | {f(med(m, i, 'replica_ms'))} | "
                  f"{both[m]:.2f} | {f(med(m, i, 'req_s'), 1)} | {f(med(m, i, 'e2e_p50_ms'), 1)} | "
                  f"{f(med(m, i, 'ttft_p50_ms'), 1)} | {f(med(m, i, 'reads'), 1)} | {ratio} |")


if __name__ == "__main__":
    main()
