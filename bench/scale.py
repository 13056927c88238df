"""Metrics-plane scale benchmark: N emulated workers → the real aggregator → R real followers.

No engines: a few emulator actors each play many workers, every emulated worker sending what a
`WorkerActor` sends (its `WorkerReport`: registration, liveness and latest ranks) through the same
code path and transport the real worker actors use (an `AggregatorLink`, one per emulator, one
`ReportBatch` frame per report), at `hz` reports per second: every report with new values (a busy
fleet), or with `--change-every K` every K-th (0: heartbeats only, an idle fleet). R follower hosts (Ray actors) each run a real `FleetFollower`
against the real aggregator, as a router replica does. Per cell (N, Hz) it prints, for R = 1 and
then R = 4 (3 more followers started cold into the running fleet):

- reports/s offered (emulated sends due) and absorbed (counted by the aggregator);
- aggregator CPU (% of one core, and µs per absorbed report);
- follower CPU (% of one core, mean over followers; an idle Ray actor's floor measured beside it)
  and deltas/s applied per follower;
- freshness p50/p99: emulator send → the value visible in a follower's `workers` (the send time
  rides in `num_requests_waiting` as µs since the run's base time; one wall clock, one machine);
- bytes per delta as the follower receives it;
- cold follower: `FleetFollower.start()` → it holds all N workers.

    python -m bench.scale [--workers 100 1000] [--hz 2 10] [--seconds 5] [--emulators 2] [--change-every K]
    python -m bench.scale --real-actors 8 [--frame-hz 30] [--seconds 20]   # real WorkerActors vs bare actors

A benchmark, not a test: figures vary with the machine's other load (the load average is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts its workers at nice 15: on a shared machine the metrics plane would measure other
# people's load (serve_app/ray_env.py runs kvroute's Ray at nice 0 for the same reason)
os.environ.setdefault("RAY_worker_niceness", "0")

import psutil  # noqa: E402
import ray  # noqa: E402


from bench.profile import thread_cpu  # noqa: E402
from bench.scale_messages import EmulatorCounters, FollowerTake  # noqa: E402  (importable: Ray pickles them by name)

VALUES = dict(request_active_slots=12, request_total_slots=64, kv_active_blocks=1250, kv_total_blocks=10_000,
              num_requests_waiting=0, gpu_cache_usage_perc=0.125, gpu_prefix_cache_hit_rate=0.5,
              data_parallel_rank=0)


@ray.remote(num_cpus=0)
class Emulator:
    """Plays `names` workers, each reporting at `hz` with its phase spread over the period: each
    worker sends what a `WorkerActor` sends — its whole report, one frame per report (new values,
    or the same ones as a heartbeat)."""

    def __init__(self, names: list[str], hz: float, base: float, settings: dict[str, Any],
                 change_every: int = 1) -> None:
        import uuid

        self.names, self.hz, self.base, self.change_every = names, hz, base, change_every
        self.reports = {n: 0 for n in names}
        self.settings = settings
        self.incarnation = {n: uuid.uuid4().hex[:12] for n in names}
        self.seq = {n: 0 for n in names}
        self.sent_us = {n: 0 for n in names}
        self.missed = 0
        self.offered = 0
        self.sent = 0
        self.coalesced = 0
        self._task: asyncio.Task | None = None

    def pid(self) -> int:
        return os.getpid()

    async def start(self) -> None:
        self._sender = await _sender(self.settings, hwm=2 * len(self.names))
        self._task = asyncio.get_running_loop().create_task(self._run())

    def counters(self) -> EmulatorCounters:
        return EmulatorCounters(offered=self.offered, sent=self.sent, coalesced=self.coalesced, missed=self.missed)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._sender.close()

    def _tick(self, name: str) -> bool:
        """A worker's turn: True if it carries new values (else it is a heartbeat)."""
        k = self.reports[name]
        self.reports[name] = k + 1
        if k == 0 or (self.change_every and k % self.change_every == 0):
            self.seq[name] += 1
            self.sent_us[name] = int((time.time() - self.base) * 1e6)
            return True
        return False

    def _build(self, name: str) -> Any:
        """What `WorkerActor._report()` builds: one rank, KV counts in blocks."""
        from actors.protocol import RankMetrics, WorkerReport

        rank = RankMetrics(**{**VALUES, "num_requests_waiting": self.sent_us[name], "age_s": 0.0,
                              "seq": self.seq[name]})
        return WorkerReport(name=name, url=f"http://127.0.0.1:1/{name}", page_size=16,
                            incarnation=self.incarnation[name], healthy=True, health_detail="ok", ranks=[rank])

    async def _run(self) -> None:
        n = len(self.names)
        period = 1.0 / self.hz
        tick = 0.005
        t0 = time.monotonic()
        due = [t0 + period * i / n for i in range(n)]
        i = 0
        while True:
            now = time.monotonic()
            while due[i] <= now:  # the workers whose turn has come, in phase order
                name = self.names[i]
                if due[i] < now - period:  # a starved emulator skips a turn, it does not burst
                    self.missed += 1
                    due[i] += period
                    i = (i + 1) % n
                    continue
                self._tick(name)
                self.offered += 1
                if self._sender.send(self._build(name)):
                    self.sent += 1
                else:
                    self.coalesced += 1
                due[i] += period
                i = (i + 1) % n
            await asyncio.sleep(max(0.0, min(tick, due[i] - time.monotonic())))


async def _sender(settings: dict[str, Any], hwm: int) -> Any:
    """One link for all the emulator's workers, queueing at most `max_pending_pushes` (2) frames
    per worker as each worker actor's own link does: a starved emulator drops, it does not buffer."""
    from actors.transport.link import AggregatorLink

    link = AggregatorLink(lambda: asyncio.to_thread(_aggregator, settings), hwm=hwm)
    while not await link.ensure():
        await asyncio.sleep(0.1)
    return _ZmqSender(link)


def _aggregator(settings: dict[str, Any]) -> Any:
    from actors.aggregator.actor import get_or_create_aggregator
    from actors.models import Settings

    return get_or_create_aggregator(Settings.model_validate(settings))


class _ZmqSender:
    """`WorkerActor._push_loop`'s send: one `ReportBatch` frame per report through an
    `AggregatorLink` (here one link, one PUSH socket, for all the emulator's workers)."""

    def __init__(self, link: Any) -> None:
        self.link = link

    def send(self, report: Any) -> bool:
        return self.link.push_reports([report])

    async def close(self) -> None:
        self.link.close()


@ray.remote(num_cpus=0)
class FollowerHost:
    """A router replica's follower and nothing else: the real `FleetFollower` on the real aggregator."""

    def __init__(self, base: float, settings: dict[str, Any]) -> None:
        self.base, self.settings = base, settings
        self.follower: Any = None
        self.lat_ms: list[float] = []
        self.seen: list[tuple[str, int, int]] = []
        self.last_sent: dict[str, int] = {}
        self.started_at = 0.0
        self.full_at: float | None = None
        self.expect = 0

    def pid(self) -> int:
        return os.getpid()

    async def start(self, expect: int) -> None:
        from actors.models import Settings
        from serve_app.follower import FleetFollower

        s = Settings.model_validate(self.settings)
        self.expect = expect
        self.follower = _follower(FleetFollower, s, self._on_update)
        self.started_at = time.monotonic()
        self.follower.start()

    def _on_update(self, changed: list[str]) -> None:
        workers = self.follower.workers
        now_us = (time.time() - self.base) * 1e6
        for name in changed:
            rec = workers.get(name)
            if rec is None or not rec.metrics:
                continue
            sent = rec.metrics["num_requests_waiting"]
            if self.last_sent.get(name) != sent:
                self.last_sent[name] = sent
                if len(self.lat_ms) < 500_000:
                    self.lat_ms.append((now_us - sent) / 1e3)
                    if len(changed) <= 64:  # small fleets only (--real-actors): view ages
                        self.seen.append((name, int(now_us), sent))
        if self.full_at is None and len(workers) >= self.expect:
            self.full_at = time.monotonic()

    def cold_s(self) -> float | None:
        return None if self.full_at is None else self.full_at - self.started_at

    def take(self) -> FollowerTake:
        """Counters since the last take (latencies and delta sizes are handed over and reset)."""
        f = self.follower
        out = FollowerTake(updates=f.updates if f else 0, lat_ms=self.lat_ms, bytes=f.bytes_received if f else 0,
                           frames=f.frames_received if f else 0, workers=len(f.workers) if f else 0,
                           resyncs=f.resyncs if f else 0, seen=self.seen)
        self.lat_ms = []
        self.seen = []
        return out

    async def stop(self) -> None:
        if self.follower is not None:
            await self.follower.stop()


def _follower(cls: Any, s: Any, on_update: Any) -> Any:
    async def resolve() -> Any:
        return await asyncio.to_thread(_aggregator, s.model_dump())

    return cls(resolve, poll_timeout_s=s.snapshot_poll_timeout_s, backoff_s=s.reconnect_backoff_s,
               backoff_max_s=s.reconnect_backoff_max_s, silence_s=s.follower_silence_s, on_update=on_update)


def _cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _view_ages_ms(seen: list[tuple[str, int, int]], t0_us: float, t1_us: float, step_us: int = 1000) -> list[float]:
    """The age of each worker's visible value (now − when the engine sent it) every `step_us` over
    [`t0_us`, `t1_us`): freshness as a router reading at a random moment sees it, which a longer
    coalescing window worsens even where "sent → visible" (the `lat_ms` samples, newest values only)
    does not."""
    by: dict[str, list[tuple[int, int]]] = {}
    for name, at, sent in seen:
        by.setdefault(name, []).append((at, sent))
    ages: list[float] = []
    for ups in by.values():
        ups.sort()
        k, sent = 0, None
        t = int(t0_us)
        while t < t1_us:
            while k < len(ups) and ups[k][0] <= t:
                sent = ups[k][1]
                k += 1
            if sent is not None:
                ages.append((t - sent) / 1e3)
            t += step_us
    return ages


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, keyed "name/tid" (`bench.profile.thread_cpu`)."""
    return {f"{name}/{tid}": s for tid, (name, s) in thread_cpu(pid).items()}


def _thread_split(before: dict[str, float], after: dict[str, float], dt: float) -> dict[str, float]:
    """% of one core per thread over `dt`, the busiest first, threads under 0.05 % summed as "rest"
    (the thread's tid is dropped; the process's main thread is named like the process)."""
    pct = {k: 100 * (after[k] - before.get(k, 0.0)) / dt for k in after}
    out: dict[str, float] = {}
    for k, v in sorted(pct.items(), key=lambda kv: -kv[1]):
        name = k.rsplit("/", 1)[0] if v >= 0.05 else "rest"
        while name in out and name != "rest":
            name += "'"
        out[name] = out.get(name, 0.0) + v
    return out


def _q(xs: list[float], p: int) -> float:
    if len(xs) < 2:
        return float("nan")
    return statistics.quantiles(xs, n=100)[p - 1]  # (nan without new values: heartbeats-only rows)


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _window(agg: Any, agg_pid: int, emus: list[Any], hosts: list[Any], host_pids: list[int], floor_pid: int,
            seconds: float) -> dict[str, Any]:
    """Measure one window of `seconds`: counters and CPU before and after."""
    for h in hosts:  # drop what accumulated before the window
        ray.get(h.take.remote())
    pids = [agg_pid, floor_pid, *host_pids]
    c0 = {p: _cpu_s(p) for p in pids}
    a0 = ray.get(agg.stats.remote())
    r0 = a0.reports
    e0 = ray.get([e.counters.remote() for e in emus])
    before = [ray.get(h.take.remote()) for h in hosts]
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    c1 = {p: _cpu_s(p) for p in pids}
    a1 = ray.get(agg.stats.remote())
    r1 = a1.reports
    e1 = ray.get([e.counters.remote() for e in emus])
    took = ray.get([h.take.remote() for h in hosts])
    offered = sum(b.offered - a.offered for a, b in zip(e0, e1)) / dt  # sends made (a starved emulator skips)
    absorbed = (r1 - r0) / dt
    agg_cpu = (c1[agg_pid] - c0[agg_pid]) / dt
    fol_cpu = statistics.mean((c1[p] - c0[p]) / dt for p in host_pids)
    lat = [x for t in took for x in t.lat_ms]
    frames = sum(t.frames - b.frames for t, b in zip(took, before))
    nbytes = sum(t.bytes - b.bytes for t, b in zip(took, before))
    deltas = statistics.mean((t.updates - b.updates) / dt for t, b in zip(took, before))
    return {
        "offered": offered, "absorbed": absorbed, "resyncs": sum(t.resyncs - b.resyncs for t, b in zip(took, before)), "agg_cpu": 100 * agg_cpu,
        "us_per_report": 1e6 * agg_cpu / absorbed if absorbed else float("nan"),
        "fol_cpu": 100 * fol_cpu, "floor_cpu": 100 * (c1[floor_pid] - c0[floor_pid]) / dt,
        "deltas_s": deltas, "p50": _q(lat, 50), "p99": _q(lat, 99), "samples": len(lat),
        "bytes": nbytes / frames if frames else float("nan"),
    }


def run_cell(n: int, hz: float, seconds: float, n_emulators: int, followers: list[int],
             change_every: int = 1, plane: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    from actors.aggregator.actor import get_or_create_aggregator, kill_aggregator
    from actors.models import Settings

    settings = Settings(**(plane or {}))
    sd = settings.model_dump()
    kill_aggregator()
    agg = get_or_create_aggregator(settings)
    agg_pid = ray.get(agg.stats.remote()).pid
    base = time.time()
    names = [f"w{i:05d}" for i in range(n)]
    emus = [Emulator.remote(names[k::n_emulators], hz, base, sd, change_every)
            for k in range(n_emulators)]
    ray.get([e.start.remote() for e in emus])
    _wait(lambda: ray.get(agg.stats.remote()).workers >= n, 60 + n / 100, f"{n} workers registered")
    floor = FollowerHost.remote(base, sd)  # never started: an idle Ray actor's own CPU floor
    floor_pid = ray.get(floor.pid.remote())
    hosts: list[Any] = []
    host_pids: list[int] = []
    rows = []
    for r in followers:
        new = [FollowerHost.remote(base, sd) for _ in range(r - len(hosts))]
        host_pids += ray.get([h.pid.remote() for h in new])
        ray.get([h.start.remote(n) for h in new])
        hosts += new
        _wait(lambda: all(c is not None for c in ray.get([h.cold_s.remote() for h in new])), 120,
              "cold followers to hold the fleet")
        cold = max(ray.get([h.cold_s.remote() for h in new]))
        time.sleep(1.0)
        row = _window(agg, agg_pid, emus, hosts, host_pids, floor_pid, seconds)
        row.update(n=n, hz=hz, r=r, cold_s=cold, change_every=change_every)
        rows.append(row)
        _print_row(row)
    ray.get([h.stop.remote() for h in hosts])
    ray.get([e.stop.remote() for e in emus])
    for a in [*hosts, floor, *emus]:
        ray.kill(a)
    kill_aggregator()
    return rows


@ray.remote(num_cpus=0)
class BareActor:
    """An async Ray actor that does nothing: the floor a worker actor's own cost is measured above."""

    async def pid(self) -> int:
        return os.getpid()


def _profile(pids: dict[str, int], seconds: float, out_dir: str) -> list[subprocess.Popen]:
    """py-spy (`.venv/bin/py-spy`, root) samples each named process for `seconds` into
    `out_dir/NAME.txt` (collapsed stacks, idle frames included so waits show)."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(out_dir, exist_ok=True)
    return [subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "--idle",
                              "-f", "raw", "-o", os.path.join(out_dir, f"{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()]


def real_actors(k: int, seconds: float, frame_hz: float = 0.0, profile: str | None = None,
                plane: dict[str, Any] | None = None) -> dict[str, Any]:
    """CPU and RSS of `k` real `WorkerActor`s (attach mode: a /health + /v1/models server, no engine)
    beside `k` bare async actors (an idle Ray actor's floor), the aggregator and one follower host;
    CPU in % of one core. `frame_hz` > 0: each actor receives that many SGLang KvMetrics frames per
    second (0.5.23 pickle form) from this process — SGLang's cadence under load is a frame per
    prefill batch and every 40 decode steps, tens a second; 0: idle (SGLang is silent when idle:
    heartbeat pushes and liveness probes only)."""
    import tempfile
    import threading

    import zmq

    from actors.aggregator.actor import get_or_create_aggregator, kill_aggregator
    from actors.fleet import parse_fleet
    from actors.worker.actor import start_worker
    from sim.sglang_shapes import encode_kv_metrics
    from tests.integration.helpers import HealthServer

    health = HealthServer()
    tmp = tempfile.mkdtemp(prefix="kvroute-real-")
    fleet = parse_fleet({"workers": [{"name": f"real{i}", "url": health.url, "metrics_endpoint": f"ipc://{tmp}/r{i}.m",
                                      "served_model_names": ["m"]} for i in range(k)], "settings": plane or {}})
    kill_aggregator()
    agg = get_or_create_aggregator(fleet.settings)
    agg_pid = ray.get(agg.stats.remote()).pid
    actors = [start_worker(w, fleet.settings, name_prefix="scale-real-") for w in fleet.workers]
    ray.get([a.ready.remote() for a in actors])
    bare = [BareActor.remote() for _ in range(k)]
    base = time.time()
    host = FollowerHost.remote(base, fleet.settings.model_dump())
    ray.get(host.start.remote(k))
    wpids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
    bpids = ray.get([b.pid.remote() for b in bare])
    hpid = ray.get(host.pid.remote())
    stop = threading.Event()

    def emit() -> None:
        ctx = zmq.Context.instance()
        socks = []
        for w in fleet.workers:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(w.metrics_endpoint)
            socks.append(sock)
        i = 0
        while not stop.is_set():
            i += 1
            for sock in socks:  # the send time rides in num_requests_waiting (µs since `base`), as emulators do
                sent_us = int((time.time() - base) * 1e6)
                sock.send(encode_kv_metrics("0.5.23", **{**VALUES, "request_active_slots": i % 64,
                                                         "num_requests_waiting": sent_us}))
            time.sleep(1.0 / frame_hz)
        for sock in socks:
            sock.close(linger=0)

    t = threading.Thread(target=emit, daemon=True)
    if frame_hz > 0:
        t.start()
    time.sleep(3.0)
    spied = {"aggregator": agg_pid, "follower": hpid, "bare_actor": bpids[0], "worker_actor": wpids[0]}
    spies = _profile(spied, seconds, profile) if profile else []
    probes0 = health.probes
    took0 = ray.get(host.take.remote())  # freshness samples from the window only
    w0_us = (time.time() - base) * 1e6
    threads = [agg_pid, hpid, bpids[0], wpids[0]]
    t_0 = {p: _thread_cpu_s(p) for p in threads}
    c0 = {p: _cpu_s(p) for p in [*wpids, *bpids, agg_pid, hpid]}
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    c1 = {p: _cpu_s(p) for p in c0}
    t_1 = {p: _thread_cpu_s(p) for p in threads}
    w1_us = (time.time() - base) * 1e6
    took = ray.get(host.take.remote())
    view = _view_ages_ms(took0.seen + took.seen, w0_us + 200_000, w1_us)  # (a 200 ms margin: every worker seen)
    probes1 = health.probes
    rss = {p: _rss_mb(p) for p in [*wpids, *bpids]}
    for spy in spies:
        spy.wait(timeout=60)
    stop.set()
    pct = {p: 100 * (c1[p] - c0[p]) / dt for p in c0}
    out = {"worker_actor": statistics.mean(pct[p] for p in wpids), "bare_actor": statistics.mean(pct[p] for p in bpids),
           "worker_actor_max": max(pct[p] for p in wpids),
           "worker_rss_mb": statistics.mean(rss[p] for p in wpids), "bare_rss_mb": statistics.mean(rss[p] for p in bpids),
           "worker_rss_max_mb": max(rss[p] for p in wpids),
           "aggregator": pct[agg_pid], "follower": pct[hpid], "processes": len(wpids),
           "probes_s": (probes1 - probes0) / dt,
           "deltas_s": (took.updates - took0.updates) / dt, "p50": _q(took.lat_ms, 50),
           "view_p50": _q(view, 50), "view_p99": _q(view, 99), "view_mean": statistics.mean(view) if view else float("nan"), "p99": _q(took.lat_ms, 99), "samples": len(took.lat_ms),
           "threads": {name: _thread_split(t_0[p], t_1[p], dt) for name, p in
                       (("aggregator", agg_pid), ("follower", hpid), ("bare", bpids[0]), ("worker actor", wpids[0]))}}
    ray.get(host.stop.remote())
    ray.get([a.stop.remote() for a in actors])
    for a in [*actors, *bare, host]:
        ray.kill(a)
    kill_aggregator()
    health.close()
    return out


def _rss_mb(pid: int) -> float:
    """Resident memory, MB (USS would leave out what the Ray worker shares with its siblings)."""
    try:
        return psutil.Process(pid).memory_info().rss / 1e6
    except psutil.Error:
        return float("nan")


HEADER = ("| N × Hz | R | offered/s | absorbed/s | aggregator % core | µs/report "
          "| follower % core (floor) | deltas/s | fresh p50 / p99 ms | bytes/delta | cold follower s | load |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _print_row(r: dict[str, Any]) -> None:
    kind = {0: " hb", 1: ""}.get(r["change_every"], f" 1/{r['change_every']}")
    print(f"| {r['n']:,} × {r['hz']:g}{kind} | {r['r']} | {r['offered']:,.0f} | {r['absorbed']:,.0f} "
          f"| {r['agg_cpu']:.0f} "
          f"| {r['us_per_report']:.0f} | {r['fol_cpu']:.1f} ({r['floor_cpu']:.1f}) | {r['deltas_s']:.0f} "
          f"| {r['p50']:.0f} / {r['p99']:.0f} | {r['bytes']:,.0f} | {r['cold_s']:.2f} | {os.getloadavg()[0]:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--hz", type=float, nargs="+", default=[2.0, 10.0])
    ap.add_argument("--followers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per row")
    ap.add_argument("--emulators", type=int, default=2)
    ap.add_argument("--change-every", type=int, default=1, metavar="K",
                    help="every K-th report of a worker carries new values, the others repeat them (heartbeats); "
                         "0: heartbeats only (an idle fleet: nothing to publish). Rows are marked 1/K or hb")
    ap.add_argument("--coalesce-s", type=float, default=None,
                    help="Settings.coalesce_s for the run (default: the setting's default, 0.05)")
    ap.add_argument("--health-busy-s", type=float, default=None,
                    help="Settings.health_busy_interval_s for the run (default: the setting's default, 5)")
    ap.add_argument("--real-actors", type=int, default=0, metavar="K",
                    help="instead: K real WorkerActors beside K bare async actors, the aggregator and one follower, "
                         "CPU of each over --seconds")
    ap.add_argument("--frame-hz", type=float, default=0.0,
                    help="with --real-actors: SGLang frames per second sent to each actor (0: idle)")
    ap.add_argument("--profile", metavar="DIR",
                    help="with --real-actors: py-spy one worker actor, the aggregator, the follower and a bare "
                         "actor over the window into DIR/NAME.txt (collapsed stacks; the CPU figures then include "
                         "py-spy's sampling)")
    ns = ap.parse_args()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# kvroute metrics-plane scale\n\nmachine: {platform.platform()}, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}, code {commit}, load average at start {os.getloadavg()[0]:.2f}")
    print(f"command: python -m bench.scale {' '.join(sys.argv[1:])}\n")
    from actors.models import NAMESPACE

    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    if ns.real_actors:
        k = ns.real_actors
        plane_cfg = {**({"coalesce_s": ns.coalesce_s} if ns.coalesce_s else {}),
                     **({"health_busy_interval_s": ns.health_busy_s} if ns.health_busy_s else {})}
        r = real_actors(k, ns.seconds, ns.frame_hz, ns.profile, plane_cfg or None)
        plane = k * r["worker_actor"] + r["aggregator"] + r["follower"]
        print(f"{k} real WorkerActors, {ns.frame_hz:g} SGLang frames/s each, {ns.seconds:g} s, load "
              f"{os.getloadavg()[0]:.1f}; % of one core: WorkerActor {r['worker_actor']:.2f} each (max "
              f"{r['worker_actor_max']:.2f}; bare async actor {r['bare_actor']:.2f} → "
              f"{r['worker_actor'] - r['bare_actor']:.2f} above the floor), aggregator {r['aggregator']:.2f}, follower "
              f"{r['follower']:.2f}; metrics plane total {plane:.1f} ({plane - (k + 2) * r['bare_actor']:.1f} above "
              f"{k + 2} actor floors); RSS MB: WorkerActor {r['worker_rss_mb']:.1f} (max {r['worker_rss_max_mb']:.1f}), "
              f"bare actor {r['bare_rss_mb']:.1f}; liveness probes {r['probes_s']:.2f}/s in all", flush=True)
        if ns.frame_hz:
            print(f"  freshness (SGLang frame sent → value in the follower's workers) p50 / p99 "
                  f"{r['p50']:.1f} / {r['p99']:.1f} ms over {r['samples']} values; the router's view age "
                  f"(now − sent of the value it holds, every ms) p50 / p99 {r['view_p50']:.1f} / {r['view_p99']:.1f}, "
                  f"mean {r['view_mean']:.1f} ms; follower deltas {r['deltas_s']:.1f}/s", flush=True)
        for who, split in r["threads"].items():
            print(f"  {who} threads, % of one core: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()),
                  flush=True)
        ray.shutdown()
        return 0
    print(HEADER, flush=True)
    try:
        for n in ns.workers:
            for hz in ns.hz:
                run_cell(n, hz, ns.seconds, ns.emulators, sorted(ns.followers), ns.change_every,
                         {"coalesce_s": ns.coalesce_s} if ns.coalesce_s else None)
    finally:
        ray.shutdown()
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
