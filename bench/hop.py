"""Latency kvroute's path adds to one reply: the same simulated worker asked directly and through
`kvroute serve` (HAProxy → router replica → worker), one measured request at a time — on an idle
fleet, or with `--background RATE` beside an open-loop stream of other requests through the router
(Poisson arrivals, 200-word prompts, 32-token replies), so the replica, HAProxy and the sim are busy
as in a benchmark trial while the pairs are measured (the sim serves both paths alike).

One sim (`python -m sim`) and one `kvroute serve` (its own local Ray) are started as child
processes, the fleet one attached worker. For each reply length the two paths alternate request
by request; per path the client's first-token time (the first body read that carries a token),
end time and reads per reply, medians, and the median of the per-pair differences (routed −
direct) with a 95 % bootstrap interval. Nothing is asserted; run it on a quiet machine:

    python -m bench.hop [--tokens 1,16,64] [--pairs 40] [--background 20] [--router KEY=JSON ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from actors.ports import free_port


def _has_text(event: bytes) -> bool:
    """An SSE event carrying generated text (not the role-only opening event, not the usage event)."""
    if not event.startswith(b"data: {"):
        return False
    try:
        choices = json.loads(event[6:]).get("choices") or []
    except ValueError:
        return False
    return any((ch.get("delta") or {}).get("content") for ch in choices)


async def _one(c: httpx.AsyncClient, url: str, model: str, n: int, k: int) -> tuple[float, float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": f"request {k} " + "hello " * 40}],
            "max_tokens": n, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = end = 0.0
    reads = 0
    pending = b""
    async with c.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for piece in r.aiter_raw():
            now = (time.perf_counter() - t0) * 1e3
            reads += 1
            if not first:  # whole SSE events only: one may be split across reads
                *events, pending = (pending + piece).split(b"\n\n")
                if any(_has_text(ev) for ev in events):
                    first = now
            end = now
    return first or end, end, reads


def _ci(diffs: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


async def _background(url: str, model: str, rate: float, stop: asyncio.Event, done: list[int]) -> None:
    """Open-loop load through `url` at `rate` req/s until `stop` (its replies are not measured)."""
    rng = random.Random(1)
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as c:
        async def one(k: int) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": f"bg {k} " + "word " * 200}],
                    "max_tokens": 32, "stream": True, "ignore_eos": True}
            async with c.stream("POST", url, json=body) as r:
                async for _ in r.aiter_raw():
                    pass
            done[0] += 1
        k = 0
        while not stop.is_set():
            t = asyncio.create_task(one(k))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            k += 1
            try:
                await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks, return_exceptions=True)


async def _measure(direct: str, routed: str, tokens: list[int], pairs: int, background: float = 0.0) -> str:
    rng = random.Random(0)
    lines = ["| reply tokens | path | first token p50 ms | end p50 ms | reads / reply | routed − direct, end: median [95 % CI] ms |",
             "|---:|---|---:|---:|---:|---:|"]
    async with httpx.AsyncClient(timeout=60) as c:
        model = (await c.get(direct + "/v1/models")).json()["data"][0]["id"]
        for base in (direct, routed):  # warm both paths (connections, caches)
            for k in range(5):
                await _one(c, base + "/v1/chat/completions", model, 4, -k)
        stop, bg_done = asyncio.Event(), [0]
        bg = asyncio.create_task(_background(routed + "/v1/chat/completions", model, background, stop, bg_done)) \
            if background > 0 else None
        if bg is not None:
            await asyncio.sleep(3.0)  # let the background load settle
        t_bg = time.perf_counter()
        for n in tokens:
            res: dict[str, list[tuple[float, float, int]]] = {"direct": [], "kvroute": []}
            for k in range(pairs):
                order = [("direct", direct), ("kvroute", routed)]
                rng.shuffle(order)
                for name, base in order:
                    res[name].append(await _one(c, base + "/v1/chat/completions", model, n, k * 2 + (name == "kvroute")))
                    await asyncio.sleep(0.02)
            diffs = [r[1] - d[1] for r, d in zip(res["kvroute"], res["direct"])]
            lo, hi = _ci(diffs, rng)
            for name in ("direct", "kvroute"):
                rows = res[name]
                tail = f"{statistics.median(diffs):.1f} [{lo:.1f}, {hi:.1f}]" if name == "kvroute" else ""
                lines.append(f"| {n} | {name} | {statistics.median(r[0] for r in rows):.1f} | "
                             f"{statistics.median(r[1] for r in rows):.1f} | {statistics.median(r[2] for r in rows):.0f} | {tail} |")
        if bg is not None:
            span = time.perf_counter() - t_bg
            stop.set()
            await bg
            lines.append(f"\nbackground: {bg_done[0]} requests through the router at {background:g} req/s offered "
                         f"({bg_done[0] / span:.1f} req/s completed during the {span:.0f} s of measurement and drain)")
    return "\n".join(lines)


def _wait(url: str, proc: subprocess.Popen, timeout_s: float, ok) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if ok(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready in {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hop", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,64", help="reply lengths (max_tokens, ignore_eos)")
    ap.add_argument("--pairs", type=int, default=40, help="requests per path and length")
    ap.add_argument("--router", action="append", default=[], metavar="KEY=JSON",
                    help="a router setting for `kvroute serve` (the fleet file's router: section), "
                    "e.g. --router stream_batching_hold_reads=false")
    ap.add_argument("--background", type=float, default=0.0, metavar="RATE",
                    help="open-loop requests per second through the router meanwhile (0: idle fleet)")
    ns = ap.parse_args(argv)
    router = {}
    for item in ns.router:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--router wants KEY=JSON, got {item!r}")
        router[key] = json.loads(value)
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-hop-"))
    sim_port, router_port = free_port(), free_port()
    metrics = f"ipc://{tmp}/metrics"
    (tmp / "fleet.yaml").write_text(f"workers:\n  - name: w0\n    url: http://127.0.0.1:{sim_port}\n"
                                    f"    metrics_endpoint: {metrics}\n    page_size: 16\n"
                                    + (f"router: {json.dumps(router)}\n" if router else ""))
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "sim", "--port", str(sim_port), "--metrics-endpoint", metrics,
                                       "--page-size", "16", "--log-level", "warning"],
                                      stdout=subprocess.DEVNULL, stderr=open(tmp / "sim.log", "w")))
        procs.append(subprocess.Popen([sys.executable, "-m", "serve_app.cli", "serve", "--fleet", str(tmp / "fleet.yaml"),
                                       "--port", str(router_port)], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                      stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT))
        direct, routed = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{router_port}"
        _wait(direct + "/health", procs[0], 60, lambda r: r.status_code == 200)
        _wait(routed + "/workers", procs[1], 180,
              lambda r: r.status_code == 200 and any(w.get("healthy") for w in r.json().get("workers", [])))
        tokens = [int(t) for t in ns.tokens.split(",")]
        print(f"router settings: {router or 'defaults'}; load average at start: {os.getloadavg()[0]:.2f}")
        print(asyncio.run(_measure(direct, routed, tokens, ns.pairs, ns.background)))
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
