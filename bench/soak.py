"""Soak: the demo fleet (local Ray, N simulated SGLang workers, the router on Ray Serve) under steady
mixed load for a while; does any kvroute process grow, does any request fail?

Samples the RSS of every kvroute process — router replica(s), worker actors, aggregator, Serve
proxy and controller, the sims — every `--sample-s` seconds, counts requests and errors, and writes
a markdown report (stdout, and `--out`): per process RSS after warm-up vs at the end, growth %, and
the post-warm-up trend; errors by kind. Target: growth ≤ 5 % after warm-up, 0 errors.

    python -m bench.soak [--minutes 10] [--warmup-minutes 2] [--workers 3] [--concurrency 6]
                         [--sample-s 10] [--out bench/results/soak.md]

Warm-up: at the default load the simulated workers' KV pools and prefix caches take ~6 minutes to
fill (their RSS climbs until then), so for a verdict on them use e.g. `--minutes 20
--warmup-minutes 6`; bench/results/soak.md has both kinds of run.

Loopback only; the load is closed-loop (each client waits for its answer), bounded by --minutes.
Needs psutil (`pip install psutil`). Exit status 0 when the targets are met, 1 when not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MIB = 1024 * 1024
TARGET_GROWTH_PCT = 5.0


# --- processes -----------------------------------------------------------------------------------


def _actor_pid(handle: Any) -> int:
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def find_processes(runner: Any) -> dict[str, int]:
    """label → pid for every kvroute process: worker actors and their sims, the aggregator, the
    router replica(s), the Serve proxy and controller (Ray's state API by actor class, then psutil
    for the sim children of each worker actor)."""
    import psutil
    from actors.aggregator.actor import AGGREGATOR_NAME, NAMESPACE

    import ray

    procs: dict[str, int] = {}
    for name, handle in runner.actors.items():
        pid = _actor_pid(handle)
        procs[f"worker actor {name}"] = pid
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if "sim" in child.cmdline():
                    procs[f"sim {name}"] = child.pid
            except psutil.Error:
                pass
    procs["aggregator"] = _actor_pid(ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE))
    # Serve's actors are named in the "serve" namespace (the state API would need the dashboard)
    for a in ray.util.list_named_actors(all_namespaces=True):
        name, ns = a["name"], a["namespace"]
        if ns != "serve":
            continue
        if "KvRouter" in name:
            label = f"router replica {name.rsplit('#', 1)[-1][:8]}"
        elif name.startswith("SERVE_PROXY_ACTOR-fallback"):  # HAProxy mode: the Python proxy behind it
            label = "serve proxy (fallback)"
        elif name.startswith("SERVE_PROXY_ACTOR"):  # the Python proxy, or HAProxy's manager
            label = "serve proxy"
        elif name.startswith("SERVE_CONTROLLER_ACTOR"):
            label = "serve controller"
        else:
            continue
        try:
            procs[label] = _actor_pid(ray.get_actor(name, namespace=ns))
        except Exception as exc:  # e.g. a replica being replaced right now
            logging.warning("no pid for %s: %s", name, exc)
            continue
        for child in psutil.Process(procs[label]).children(recursive=True):  # the haproxy it runs
            try:
                if child.name() == "haproxy":
                    procs["haproxy"] = child.pid
            except psutil.Error:
                pass
    return procs


def rss_mib(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / MIB
    except psutil.Error:
        return None


# --- load ----------------------------------------------------------------------------------------

_WORDS = ("kv cache prefix route worker token scheduler batch decode prefill latency memory page "
          "block queue stream model engine request answer question summary detail ray serve").split()


@dataclass
class LoadStats:
    ok: Counter = field(default_factory=Counter)  # kind → successful requests
    errors: Counter = field(default_factory=Counter)  # "kind: what" → count
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def total_ok(self) -> int:
        return sum(self.ok.values())

    def total_errors(self) -> int:
        return sum(self.errors.values())


def _prompt(rng: random.Random, systems: list[str]) -> tuple[str, str]:
    """A shared system prompt (prefix reuse across requests) + a fresh user question."""
    return rng.choice(systems), " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(8, 60)))


async def _one(client: Any, rng: random.Random, systems: list[str], stats: LoadStats, max_tokens: int) -> None:
    kind = rng.choice(("chat", "chat-stream", "completion", "completion-stream"))
    system, user = _prompt(rng, systems)
    n = rng.randrange(4, max_tokens + 1)
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"model": "default", "max_tokens": n,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    else:
        path = "/v1/completions"
        body = {"model": "default", "max_tokens": n, "prompt": system + "\n" + user}
    stream = kind.endswith("stream")
    body["stream"] = stream
    t0 = time.perf_counter()
    try:
        if stream:
            async with client.stream("POST", path, json=body) as r:
                text = "".join([chunk async for chunk in r.aiter_text()])
                if r.status_code != 200:
                    raise _Failed(f"status {r.status_code}")
                if not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
                    raise _Failed("stream without [DONE] or with an error event")
        else:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                raise _Failed(f"status {r.status_code}: {r.text[:80]}")
            usage = r.json().get("usage") or {}
            if usage.get("completion_tokens") != n:
                raise _Failed(f"completion_tokens {usage.get('completion_tokens')} != {n}")
    except _Failed as exc:
        with stats.lock:
            stats.errors[f"{kind}: {exc}"] += 1
        return
    except Exception as exc:  # transport errors, bad JSON …
        with stats.lock:
            stats.errors[f"{kind}: {type(exc).__name__}"] += 1
        return
    with stats.lock:
        stats.ok[kind] += 1
        stats.latencies.append(time.perf_counter() - t0)


class _Failed(Exception):
    pass


async def _watch(client: Any, stats: LoadStats, n_workers: int, stop: asyncio.Event) -> None:
    """Every 5 s: /healthz is ok and /workers lists every worker, none down."""
    while not stop.is_set():
        try:
            h = await client.get("/healthz")
            w = await client.get("/workers")
            workers = w.json()["workers"]
            if h.status_code != 200 or h.json().get("status") != "ok":
                stats.errors[f"healthz: status {h.status_code} {h.json().get('status')}"] += 1
            elif len(workers) != n_workers or any(x["state"] == "down" for x in workers):
                stats.errors["workers: a worker missing or down"] += 1
            else:
                stats.ok["status checks"] += 1
        except Exception as exc:
            stats.errors[f"status checks: {type(exc).__name__}"] += 1
        try:
            await asyncio.wait_for(stop.wait(), 5)
        except asyncio.TimeoutError:
            pass


async def run_load(url: str, seconds: float, concurrency: int, n_workers: int, stats: LoadStats,
                   max_tokens: int, think_s: float, seed: int) -> None:
    import httpx

    rng = random.Random(seed)
    systems = [f"You are assistant #{i}. " + " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(40, 200)))
               for i in range(64)]
    stop = asyncio.Event()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def loop(i: int) -> None:
            r = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await _one(client, r, systems, stats, max_tokens)
                await asyncio.sleep(think_s * r.uniform(0.5, 1.5))

        watcher = asyncio.create_task(_watch(client, stats, n_workers, stop))
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        stop.set()
        await watcher


# --- sampling and the report --------------------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since load start
    rss: dict[str, float | None]
    ok: int
    errors: int


def _sampler(procs: dict[str, int], stats: LoadStats, samples: list[Sample], t0: float, every_s: float,
             stop: threading.Event) -> None:
    while True:
        samples.append(Sample(time.monotonic() - t0, {k: rss_mib(p) for k, p in procs.items()},
                              stats.total_ok(), stats.total_errors()))
        if stop.wait(every_s):
            samples.append(Sample(time.monotonic() - t0, {k: rss_mib(p) for k, p in procs.items()},
                                  stats.total_ok(), stats.total_errors()))
            return


def _window_median(samples: list[Sample], label: str, lo: float, hi: float) -> float | None:
    vals = [s.rss[label] for s in samples if lo <= s.t <= hi and s.rss.get(label) is not None]
    return statistics.median(vals) if vals else None


def _slope_mib_per_h(samples: list[Sample], label: str, after: float) -> float | None:
    pts = [(s.t, s.rss[label]) for s in samples if s.t >= after and s.rss.get(label) is not None]
    if len(pts) < 3:
        return None
    mx = statistics.fmean(t for t, _ in pts)
    my = statistics.fmean(v for _, v in pts)
    den = sum((t - mx) ** 2 for t, _ in pts)
    return 0.0 if den == 0 else sum((t - mx) * (v - my) for t, v in pts) / den * 3600


def report(args: argparse.Namespace, procs: dict[str, int], samples: list[Sample], stats: LoadStats,
           load_s: float, started: str) -> tuple[str, bool]:
    warm = args.warmup_minutes * 60
    end = samples[-1].t
    win = max(args.sample_s * 2.5, 30.0)  # median of a few samples on each side: RSS is noisy
    rows = []
    worst = 0.0
    for label in procs:
        base = _window_median(samples, label, warm, warm + win)
        last = _window_median(samples, label, end - win, end)
        peak = max((s.rss[label] for s in samples if s.t >= warm and s.rss.get(label) is not None), default=None)
        if base is None or last is None:
            rows.append(f"| {label} | {procs[label]} | – | – | – | – | – | **gone** |")
            worst = float("inf")
            continue
        growth = (last - base) / base * 100
        worst = max(worst, growth)
        slope = _slope_mib_per_h(samples, label, warm)
        verdict = "ok" if growth <= TARGET_GROWTH_PCT else "**over target**"
        rows.append(f"| {label} | {procs[label]} | {base:.1f} | {last:.1f} | {peak:.1f} | {growth:+.2f} % | "
                    f"{'–' if slope is None else f'{slope:+.1f}'} | {verdict} |")
    n_ok = stats.total_ok() - stats.ok.get("status checks", 0)
    lat = sorted(stats.latencies)
    p50 = lat[len(lat) // 2] * 1000 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else float("nan")
    errors = stats.total_errors()
    passed = worst <= TARGET_GROWTH_PCT and errors == 0
    cmd = "python -m bench.soak " + " ".join(sys.argv[1:])
    out = [
        "# Soak: demo fleet under steady load",
        "",
        f"`{cmd}` — started {started}; {platform.node()}: {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; shared machine (other jobs may have run alongside).",
        "",
        f"**Verdict: {'PASS' if passed else 'FAIL'}** — worst RSS growth after warm-up {worst:+.2f} % "
        f"(target ≤ {TARGET_GROWTH_PCT:.0f} %), {errors} errors (target 0).",
        "",
        f"Load: {args.workers} simulated SGLang workers (time scale {args.time_scale}), {args.concurrency} closed-loop "
        f"clients for {load_s / 60:.1f} min, a random mix of chat / completion × streaming / not (max_tokens 4–"
        f"{args.max_tokens}, 64 shared system prompts + fresh questions), plus /healthz and /workers every 5 s. "
        f"{n_ok} requests OK ({n_ok / load_s:.1f}/s; "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats.ok.items()) if k != "status checks")
        + f"), {stats.ok.get('status checks', 0)} status checks OK; latency p50 {p50:.0f} ms, p99 {p99:.0f} ms.",
        "",
        f"RSS sampled every {args.sample_s:.0f} s. *After warm-up* = median over [{warm:.0f} s, {warm + win:.0f} s]; "
        f"*end* = median over the last {win:.0f} s; *trend* = least-squares slope after warm-up.",
        "",
        "| process | pid | RSS after warm-up (MiB) | RSS at end (MiB) | peak after warm-up (MiB) | growth | trend (MiB/h) | |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Errors: " + ("none." if not errors else ""),
        *[f"- {k}: {v}" for k, v in stats.errors.most_common()],
        "",
        "RSS over time (MiB):",
        "",
        "| t (s) | requests OK | errors | " + " | ".join(procs) + " |",
        "|---" * (len(procs) + 3) + "|",
    ]
    step = max(1, len(samples) // 20)
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        out.append(f"| {s.t:.0f} | {s.ok} | {s.errors} | "
                   + " | ".join("–" if s.rss.get(k) is None else f"{s.rss[k]:.1f}" for k in procs) + " |")
    return "\n".join(out) + "\n", passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="growth is measured from here (default: 20 %% of --minutes, at most 2)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=6, help="closed-loop clients")
    p.add_argument("--think-s", type=float, default=0.05, help="mean pause between a client's requests")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--time-scale", type=float, default=0.05, help="sim engine time scale (<1 = faster)")
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    p.add_argument("--port", type=int, default=None, help="router HTTP port (default: a free one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--json", default=None, help="also write the raw samples here")
    args = p.parse_args(argv)
    if args.warmup_minutes is None:
        args.warmup_minutes = min(2.0, args.minutes * 0.2)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("bench.soak needs psutil: pip install psutil", file=sys.stderr)
        return 2

    from serve_app.cli import FleetRunner, demo_fleet
    from serve_app.config import RouterConfig
    from sim.launch import free_port

    def progress(msg: str) -> None:
        print(f"[soak] {msg}", file=sys.stderr, flush=True)

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with tempfile.TemporaryDirectory(prefix="kvroute-soak-") as tmp:
        fleet = demo_fleet(args.workers, tmpdir=tmp, time_scale=args.time_scale)
        runner = FleetRunner(fleet, RouterConfig(), host="127.0.0.1", port=args.port or free_port(), address=None,
                             progress=progress)
        try:
            url = runner.start()
            import httpx

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    ws = httpx.get(url + "/workers", timeout=5).json()["workers"]
                    if len(ws) == args.workers and all(w["state"] != "down" for w in ws):
                        break
                except Exception:
                    pass
                time.sleep(0.5)
            else:
                progress("workers never all up in /workers")
                return 2
            procs = find_processes(runner)
            progress("processes: " + ", ".join(f"{k}={v}" for k, v in procs.items()))
            stats = LoadStats()
            samples: list[Sample] = []
            stop = threading.Event()
            t0 = time.monotonic()
            sampler = threading.Thread(target=_sampler, args=(procs, stats, samples, t0, args.sample_s, stop),
                                       daemon=True)
            sampler.start()
            progress(f"load for {args.minutes:g} min on {url} (warm-up {args.warmup_minutes:g} min) …")
            ticker_stop = threading.Event()

            def ticker() -> None:
                while not ticker_stop.wait(60):
                    progress(f"t={time.monotonic() - t0:.0f} s: {stats.total_ok()} ok, {stats.total_errors()} errors")

            threading.Thread(target=ticker, daemon=True).start()
            asyncio.run(run_load(url, args.minutes * 60, args.concurrency, args.workers, stats, args.max_tokens,
                                 args.think_s, args.seed))
            load_s = time.monotonic() - t0
            ticker_stop.set()
            stop.set()
            sampler.join(30)
            text, passed = report(args, procs, samples, stats, load_s, started)
        finally:
            runner.stop()
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"procs": procs, "samples": [s.__dict__ for s in samples],
                       "errors": dict(stats.errors), "ok": dict(stats.ok)}, f)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
