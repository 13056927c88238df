"""CPU seconds per process family during a benchmark trial.

Every process of the run (this one — the load generator — and all its descendants: Ray's own
processes, the Serve controller and replicas, HAProxy, kvroute's metrics plane, the simulated
engines, a peer router) is sampled at the start and the end of a trial and put in one family by
its command line / Ray process title. A process that started during the trial counts from zero; one
that exited during it counts what it had used when last seen (the figures are a lower bound then).

Families (first match wins):

| family | processes |
|---|---|
| `engines` | simulated SGLang workers (`python -m sim`), real ones (`actors.sglang_launch`), Serve-hosted sims |
| `peer router` | sglang-router (`sglang_router.launch_router`) |
| `router:<target>` | a `dynamo-kv*` proxy (`bench.dynamo_kv`), one family per configuration |
| `ingress` | HAProxy, Ray's HAProxy manager and Serve's Python proxy actor |
| `serve controller` | Ray Serve's controller |
| `metrics plane` | kvroute's aggregator and worker actors |
| `replica:<app>` | Ray Serve replicas, per Serve application (kvroute's router is app `kvroute`) |
| `ray system` | GCS, raylet, dashboard and its agents, log monitor, idle Ray workers |
| `load generator` | this process (the benchmark driver runs the load generator's event loop) |
| `other` | anything else under this process |
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import psutil

FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("engines", re.compile(r"-m sim\b|actors\.sglang_launch|ServeReplica:[^:]+:SimEngine")),
    ("peer router", re.compile(r"sglang_router|sglang::router")),
    ("router", re.compile(r"-m bench\.dynamo_kv --name (\S+)")),  # one family per Dynamo configuration
    ("ingress", re.compile(r"haproxy|ray::HAProxyManager|ray::ProxyActor")),
    ("serve controller", re.compile(r"ray::ServeController")),
    ("metrics plane", re.compile(r"ray::Aggregator|ray::WorkerActor")),
    ("replica", re.compile(r"ray::ServeReplica:([^:\s]+)")),
    ("ray system", re.compile(r"gcs_server|raylet|dashboard|log_monitor|ray::IDLE|ray/_private|monitor\.py|ray::")),
)


def family(cmdline: str) -> str:
    """The family of one process, from its command line (or Ray process title)."""
    for name, pat in FAMILIES:
        m = pat.search(cmdline)
        if m:
            return f"{name}:{m.group(1)}" if name in ("replica", "router") else name
    return "other"


def _busy_s() -> float:
    try:
        f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def keep_orphans() -> bool:
    """Make this process the child subreaper of everything it starts (Linux): a process whose parent
    exits is re-parented here instead of to init, so it stays in this run's process tree (a daemon
    that detaches from what started it would otherwise count as "other jobs"). False where
    unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


class CpuMeter:
    """CPU used during an interval by this run, per family, and by everything else on the machine.
    The run's processes are this process's descendants (`keep_orphans` keeps detached ones in)."""

    def __init__(self) -> None:
        keep_orphans()
        self._root = psutil.Process()
        self._t0 = self._busy0 = 0.0
        self._start: dict[int, tuple[float, str]] = {}
        self._last: dict[int, tuple[float, str]] = {}
        self._names: dict[int, str] = {}

    def _sample(self) -> dict[int, tuple[float, str]]:
        out: dict[int, tuple[float, str]] = {}
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            procs = [self._root]
        for p in procs:
            try:
                name = self._names.get(p.pid)
                if name is None:
                    name = "load generator" if p.pid == self._root.pid else family(" ".join(p.cmdline()))
                    self._names[p.pid] = name
                t = p.cpu_times()
                out[p.pid] = (t.user + t.system, name)
            except psutil.Error:
                continue
        return out

    def start(self) -> None:
        self._names.clear()
        self._start = self._last = self._sample()
        self._t0, self._busy0 = time.monotonic(), _busy_s()

    def poll(self) -> None:
        """Take a sample mid-trial (keeps the CPU of processes that exit before `stop`)."""
        self._last = {**self._last, **self._sample()}

    def stop(self) -> dict[str, Any]:
        dt = max(time.monotonic() - self._t0, 1e-9)
        busy = _busy_s() - self._busy0
        end = {**self._last, **self._sample()}
        fam: dict[str, float] = {}
        for pid, (cpu, name) in end.items():
            before = self._start.get(pid, (0.0, name))[0]
            fam[name] = fam.get(name, 0.0) + max(0.0, cpu - before)
        mine = sum(fam.values())
        return {"busy_cores": busy / dt, "bench_cores": mine / dt, "foreign_cores": max(0.0, busy - mine) / dt,
                "seconds": dt, "families_cpu_s": {k: round(v, 3) for k, v in sorted(fam.items())}}


def router_side_cpu_s(families: dict[str, float], target: str, app: str | None) -> float | None:
    """CPU seconds of the processes that route for `target`: for a kvroute target its Serve replica
    (`app`), the ingress, the Serve controller, the metrics plane and Ray's own processes; for
    sglang-router its process; for other Serve targets their replica, ingress, controller and Ray."""
    if target.startswith("sglang-"):
        return families.get("peer router", 0.0)
    if target.startswith("dynamo-"):  # its proxy process: HTTP front, Dynamo's selection core, relay
        return families.get(f"router:{target}", 0.0)
    if target == "direct":
        return None
    keys = ["ingress", "serve controller", "ray system"]
    if target.startswith("kvroute-"):
        keys.append("metrics plane")
    total = sum(families.get(k, 0.0) for k in keys)
    if app is not None:
        total += families.get(f"replica:{app}", 0.0)
    return total
