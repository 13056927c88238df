"""CPU of one event-loop wake-up on this machine: a uvloop task that only sleeps, in a loop.

Run: python -m bench.wakeup [--seconds 4]

Every timer or socket event that wakes an idle event loop costs the kernel's sleep and wake-up (and
on a VM the hypervisor's timer) plus one loop iteration, before any work of the event's own. This
measures that floor: the process's CPU time ÷ wake-ups of `await asyncio.sleep(interval)`. It is
what a router replica pays per relayed piece when every stream's batch window is a timer of its
own (`serve_app.proxy._Ticks`, `bench/results/request-path-2.md`, round 4).
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def _sleeper(interval_s: float, seconds: float) -> tuple[int, float]:
    t0 = time.process_time()
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        await asyncio.sleep(interval_s)
        n += 1
    return n, time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    import uvloop

    uvloop.install()
    t0 = time.process_time()
    time.sleep(1.0)
    print(f"sleeping thread, 1 s: {(time.process_time() - t0) * 1e6:.0f} µs CPU")
    for interval in (0.05, 0.01):
        n, cpu = asyncio.run(_sleeper(interval, a.seconds))
        print(f"uvloop, sleep {interval * 1e3:.0f} ms: {n} wake-ups, {cpu / n * 1e6:.0f} µs CPU each")


if __name__ == "__main__":
    main()
