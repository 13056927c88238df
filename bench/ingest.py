"""Ingest benchmark: how fast a worker actor's receive path is, and how fresh the router's view is.

Prints, in one run:
1. frames/s of a bare ZMQ `recv` loop vs recv + decode + validate (`MetricsBook.ingest`), with a
   separate sender process pushing real SGLang frames; the ratio is measured side by side,
   alternating the two loops.
2. freshness: time from an emitter's send to the value being applied in a router replica's
   snapshot (the replica stamps `updated_at` when it applies a record), p50/p99, for 8 and 64
   emitters, each a real worker actor on a local Ray with the router deployed on Ray Serve.

    python -m bench.ingest [--frames 200000] [--rounds 3] [--emitters 8 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import zmq

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

VALUES = dict(
    request_active_slots=12, request_total_slots=64, kv_active_blocks=20_000, kv_total_blocks=160_000,
    num_requests_waiting=3, gpu_cache_usage_perc=0.125, gpu_prefix_cache_hit_rate=0.5, data_parallel_rank=0,
)


DISTINCT_FRAMES = 4096  # the sender cycles this many different reports (no per-bytes caching can win)


def _varied_values(count: int = DISTINCT_FRAMES, seed: int = 1) -> list[dict]:
    """Reports as a loaded scheduler sends them: slots and token counts of several server sizes
    (BININT1/BININT2/BININT values), usage consistent with the counts, hit rates from decode 0.0
    to prefill batches, a few DP ranks."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        slots = rng.choice((48, 64, 256, 1024))
        tokens = rng.choice((160_000, 500_000, 1_200_000, 3_000_000))
        used = rng.randrange(tokens + 1)
        out.append(dict(
            request_active_slots=rng.randrange(slots + 1), request_total_slots=slots,
            kv_active_blocks=used, kv_total_blocks=tokens, num_requests_waiting=rng.choice((0, rng.randrange(1000))),
            gpu_cache_usage_perc=used / tokens, gpu_prefix_cache_hit_rate=rng.choice((0.0, rng.random())),
            data_parallel_rank=rng.randrange(4),
        ))
    return out


def _sender(endpoint: str, n: int, form: str) -> None:
    from sim.sglang_shapes import encode_kv_metrics

    frames = [encode_kv_metrics(form, **v) for v in _varied_values()]
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    for i in range(n):
        s.send(frames[i % len(frames)], copy=False)
    s.close(linger=-1)
    ctx.term()


def _receive(endpoint: str, n: int, form: str, decode: bool) -> float:
    from actors.worker.ingest import MetricsBook

    expected = _varied_values()
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 0)
    s.bind(endpoint)
    book = MetricsBook(64 * 1024)
    p = mp.get_context("spawn").Process(target=_sender, args=(endpoint, n, form))
    p.start()
    s.recv()  # first frame starts the clock
    t0 = time.perf_counter()
    if decode:
        for _ in range(n - 1):
            book.ingest(s.recv())
    else:
        for _ in range(n - 1):
            s.recv()
    dt = time.perf_counter() - t0
    p.join()
    s.close(linger=0)
    ctx.term()
    if decode:  # every frame accepted, and the values kept are the ones last sent per rank
        assert book.stats.frames_accepted == n - 1, book.stats.as_dict()
        last: dict[int, dict] = {}
        for i in range(n):
            v = expected[i % len(expected)]
            last[v["data_parallel_rank"]] = v
        assert {r: m.model_dump() for r, m in book.latest().items()} == last
    return (n - 1) / dt


def bench_decode(frames: int, rounds: int) -> list[dict]:
    rows = []
    tmp = tempfile.mkdtemp(prefix="kvroute-bench-")
    try:
        for form in ("0.5.23", "0.5.8", "0.5.23-msgpack"):
            bare, dec = [], []
            for r in range(rounds):
                bare.append(_receive(f"ipc://{tmp}/b{r}", frames, form, decode=False))
                dec.append(_receive(f"ipc://{tmp}/d{r}", frames, form, decode=True))
            b, d = statistics.median(bare), statistics.median(dec)
            rows.append({"form": form, "bare": b, "decode": d, "ratio": d / b})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _proc_group(p) -> str:
    try:
        cmd = p.cmdline()
    except Exception:
        return "?"
    if not cmd:
        return p.name()
    head = cmd[0]
    if head.startswith("ray::"):
        g = head.split()[0]
        for k in ("WorkerActor", "Aggregator", "ServeReplica", "ProxyActor", "ServeController"):
            if k in g:
                return "ray::" + k
        return g[:40]
    base = os.path.basename(head)
    if "python" in base and len(cmd) > 1:
        for a in cmd[1:4]:
            if "bench.ingest" in a:
                return "bench driver"
            if a.endswith(".py"):
                return os.path.basename(a)
        return base
    return base[:40]


def _cpu_times() -> dict[int, tuple[str, float]]:
    import psutil

    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[p.pid] = (_proc_group(p), t.user + t.system)
        except Exception:
            pass
    return out


def _cpu_by_group(a: dict, b: dict, dt: float) -> dict[str, tuple[int, float]]:
    """% of one core per process group between two samples, and how many processes."""
    groups: dict[str, list[float]] = {}
    for pid, (g, t) in b.items():
        t0 = a.get(pid, (g, 0.0))[1] if pid in a else 0.0
        groups.setdefault(g, []).append(max(0.0, t - t0))
    return {g: (len(v), 100 * sum(v) / dt) for g, v in groups.items()}


def bench_freshness(n_emitters: int, seconds: float, period_s: float, poll_s: float = 0.01, cpu: bool = False,
                    idle_s: float = 0.0) -> dict:
    import httpx
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator, kill_aggregator
    from actors.fleet import parse_fleet
    from actors.worker.actor import start_worker
    from serve_app.app import build_app
    from sim.sglang_shapes import encode_kv_metrics
    from tests.integration.helpers import HealthServer

    tmp = tempfile.mkdtemp(prefix="kvroute-fresh-")
    health = HealthServer()
    fleet = parse_fleet({"workers": [
        {"name": f"e{i}", "url": health.url, "metrics_endpoint": f"ipc://{tmp}/e{i}.metrics"} for i in range(n_emitters)
    ]})
    agg = get_or_create_aggregator(fleet.settings)
    ray.get(agg.ping.remote())
    actors = [start_worker(w, fleet.settings, name_prefix=f"bench{n_emitters}-") for w in fleet.workers]
    ray.get([a.ready.remote() for a in actors])
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False}), name=f"fresh{n_emitters}", route_prefix=f"/fresh{n_emitters}")
    base = f"http://127.0.0.1:{BENCH_PORT}/fresh{n_emitters}"
    client = httpx.Client(base_url=base, timeout=10)
    deadline = time.monotonic() + 60
    while len(client.get("/workers").json()["workers"]) < n_emitters:
        if time.monotonic() > deadline:
            raise SystemExit("workers did not register")
        time.sleep(0.1)

    ctx = zmq.Context.instance()
    socks = []
    for w in fleet.workers:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(w.metrics_endpoint)
        socks.append(s)
    sent: dict[tuple[int, int], float] = {}
    stop = threading.Event()

    def emit():
        k = 0
        nxt = time.monotonic()
        while not stop.is_set():
            k += 1
            for i, s in enumerate(socks):  # a spread-out send per emitter per period
                sent[(i, k)] = time.time()
                s.send(encode_kv_metrics("0.5.23", **{**VALUES, "request_active_slots": k}))
                time.sleep(period_s / len(socks) * 0.5)
            nxt += period_s
            time.sleep(max(0.0, nxt - time.monotonic()))

    t = threading.Thread(target=emit, daemon=True)
    cpu_idle = cpu_load = None
    time.sleep(0.5)
    if idle_s > 0 and cpu:  # the fleet registered, nothing emitted: background cost only
        c0, t0 = _cpu_times(), time.monotonic()
        time.sleep(idle_s)
        cpu_idle = _cpu_by_group(c0, _cpu_times(), time.monotonic() - t0)
    t.start()
    seen: dict[tuple[int, int], float] = {}
    time.sleep(min(1.0, seconds / 4))
    if cpu:
        c0, t0 = _cpu_times(), time.monotonic()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for w in client.get("/workers").json()["workers"]:
            i = int(w["name"][1:])
            k = (w["metrics"] or {}).get("request_active_slots")
            if k and (i, k) not in seen:
                seen[(i, k)] = w["updated_at"]
        time.sleep(poll_s)
    if cpu:
        cpu_load = _cpu_by_group(c0, _cpu_times(), time.monotonic() - t0)
    stop.set()
    t.join()
    lat = sorted((seen[key] - sent[key]) * 1000 for key in seen if key in sent and key[1] > 1)
    for s in socks:
        s.close(linger=0)
    client.close()
    serve.delete(f"fresh{n_emitters}")
    ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=15)
    for a in actors:
        ray.kill(a, no_restart=True)
    kill_aggregator()
    health.close()
    shutil.rmtree(tmp, ignore_errors=True)
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99

    return {"emitters": n_emitters, "samples": len(lat), "p50": q[49], "p99": q[98], "max": max(lat) if lat else float("nan"),
            "cpu_idle": cpu_idle, "cpu_load": cpu_load}


BENCH_PORT = 18765


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--emitters", type=int, nargs="*", default=[8, 64])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--period", type=float, default=0.25, help="seconds between two sends of one emitter")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between two GET /workers of the bench (each value stays 1 period)")
    ap.add_argument("--cpu", action="store_true", help="CPU per process group, idle and under load")
    ns = ap.parse_args()

    print(f"# kvroute ingest benchmark\n\nmachine: {platform.platform()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print(f"command: python -m bench.ingest {' '.join(sys.argv[1:])}\n")
    print("## Receive path: bare recv vs recv + decode + validate (median of rounds)\n")
    print("| wire form | bare recv frames/s | decode+validate frames/s | ratio |")
    print("|---|---:|---:|---:|")
    for r in bench_decode(ns.frames, ns.rounds):
        print(f"| {r['form']} | {r['bare']:,.0f} | {r['decode']:,.0f} | {r['ratio']:.2f} |")
    sys.stdout.flush()
    if ns.emitters:
        import ray
        from ray import serve

        from actors.models import NAMESPACE

        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": BENCH_PORT})
        print("\n## Freshness: emitter send → applied in a router replica's snapshot\n")
        print("| emitters | samples | p50 ms | p99 ms | max ms |")
        print("|---:|---:|---:|---:|---:|")
        for n in ns.emitters:
            f = bench_freshness(n, ns.seconds, ns.period, ns.poll, ns.cpu, idle_s=3.0 if ns.cpu else 0.0)
            print(f"| {f['emitters']} | {f['samples']} | {f['p50']:.1f} | {f['p99']:.1f} | {f['max']:.1f} |")
            for label in ("cpu_idle", "cpu_load"):
                if f[label]:
                    tot = sum(c for _, c in f[label].values())
                    print(f"    {label} total {tot:.0f}% of a core:")
                    for g, (np_, c) in sorted(f[label].items(), key=lambda x: -x[1][1])[:12]:
                        print(f"      {g:32s} x{np_:<3d} {c:6.1f}%")
            sys.stdout.flush()
        serve.shutdown()
        ray.shutdown()
    print("\ntargets: decode ≥ 0.7× bare recv and ≥ 100k frames/s; freshness p99 ≤ 25 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
