"""What a kvroute cluster costs while nobody sends a request: CPU per process, idle.

The request-path benchmark (`bench.run`) charges every router-side process's CPU to the requests of
a trial; part of it is paid per second whatever the rate — Ray's own processes, the Serve
controller, the ingress, the metrics plane. This measures that floor directly: a local Ray, kvroute's
`FleetRunner` with N managed simulated workers (idle: SGLang sends no KvMetrics while idle, so the
metrics plane runs only its liveness), the router app, and nothing else; after a warm-up, the CPU
time each process used over a window, in % of one core, by process.

    python -m bench.idle [--workers 4] [--seconds 60] [--env KEY=VALUE ...]

`--env` sets an environment variable before Ray starts (every Ray process inherits it), to weigh a
setting of Ray's or Serve's periodic work against the floor it costs; run once per variant (a Ray
process reads its settings when it starts). Prints one table and the figure per request at 20 and
200 req/s.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# finer than bench.cpu's families: which of Ray's own processes
PROCESSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("engines (sims)", re.compile(r"-m sim\b")),
    ("haproxy", re.compile(r"haproxy(?!.*ray::)")),
    ("HAProxyManager actor", re.compile(r"ray::HAProxyManager")),
    ("Serve ProxyActor", re.compile(r"ray::ProxyActor")),
    ("Serve controller", re.compile(r"ray::ServeController")),
    ("aggregator", re.compile(r"ray::Aggregator")),
    ("worker actors", re.compile(r"ray::WorkerActor")),
    ("router replica", re.compile(r"ray::ServeReplica")),
    ("gcs_server", re.compile(r"gcs_server")),
    ("raylet", re.compile(r"raylet")),
    ("dashboard agent", re.compile(r"ray::DashboardAgent|dashboard/agent")),
    ("runtime env agent", re.compile(r"ray::RuntimeEnvAgent")),
    ("autoscaler monitor", re.compile(r"autoscaler/_private/monitor")),
    ("dashboard", re.compile(r"dashboard")),
    ("log_monitor", re.compile(r"log_monitor")),
    ("idle Ray workers", re.compile(r"ray::IDLE")),
    ("other Ray", re.compile(r"ray")),
)


def label(cmdline: str) -> str:
    for name, pat in PROCESSES:
        if pat.search(cmdline):
            return name
    return "other"


UNNAMED: dict[str, set[str]] = {}  # command lines of the catch-all rows, printed under the table


def sample(root) -> dict[int, tuple[float, str]]:
    import psutil

    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            cmd = " ".join(p.cmdline())
            name = "driver (this process)" if p.pid == root.pid else label(cmd)
            out[p.pid] = (t.user + t.system, name)
            if name in ("other Ray", "other"):
                UNNAMED.setdefault(name, set()).add(cmd[:100])
        except psutil.Error:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ns = ap.parse_args(argv)
    for kv in ns.env:
        k, sep, v = kv.partition("=")
        if not sep:
            ap.error(f"--env wants KEY=VALUE, got {kv!r}")
        os.environ[k] = v
    import psutil

    from bench.run import ENGINE
    from bench.targets import BenchFleet

    fleet = BenchFleet(ns.workers, ENGINE, progress=lambda m: print(m, file=sys.stderr),
                       targets_enabled=("kvroute-kv_aware",))
    try:
        fleet.start()
        time.sleep(ns.warmup)
        root = psutil.Process()
        load0 = os.getloadavg()
        a, t0 = sample(root), time.monotonic()
        time.sleep(ns.seconds)
        b, dt = sample(root), time.monotonic() - t0
        load1 = os.getloadavg()
    finally:
        fleet.stop()
    per: dict[str, list[float]] = {}
    for pid, (cpu, name) in b.items():
        per.setdefault(name, []).append(max(0.0, cpu - a.get(pid, (0.0, name))[0]))
    print(f"# idle kvroute cluster: {ns.workers} simulated workers, {dt:.0f} s window after {ns.warmup:.0f} s; "
          f"env {' '.join(ns.env) or '(kvroute defaults)'}; load average {load0[0]:.1f} → {load1[0]:.1f}\n")
    print("| process | count | % of one core | ms per request at 20 req/s | at 200 req/s |")
    print("|---|---:|---:|---:|---:|")
    total = router = 0.0
    for name, vals in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        pct = sum(vals) / dt * 100
        total += pct
        if name not in ("engines (sims)", "driver (this process)"):
            router += pct
        print(f"| {name} | {len(vals)} | {pct:.2f} | {pct / 100 / 20 * 1e3:.2f} | {pct / 100 / 200 * 1e3:.2f} |")
    print(f"| **router side (all but engines and driver)** | | **{router:.2f}** | **{router / 100 / 20 * 1e3:.2f}** | "
          f"**{router / 100 / 200 * 1e3:.2f}** |")
    for name, cmds in UNNAMED.items():
        print(f"\n{name}: " + "; ".join(f"`{c}`" for c in sorted(cmds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
