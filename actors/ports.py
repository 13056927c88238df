"""Picking a TCP port for something that binds it a moment later (an engine, a KV-event socket, a
Serve port, HAProxy's listeners) — the one place kvroute does it.

A port-0 bind gives a port from the kernel's ephemeral range (32768-60999 by default), and that
range is exactly where every outgoing connection takes its source port: between the pick and the
bind, Ray's gRPC clients (they open many at start), the metrics plane or a test's client can take it,
and the engine or HAProxy then fails with "Address already in use". So ports are picked from fixed
ranges below it, one per kind of listener so two pickers never collide:

| range | for |
|---|---|
| 12000-19999 | engines' HTTP, KV-event PUB/replay sockets, Serve's HTTP port in tests and benchmarks |
| 20000-27999 | HAProxy's stats and Prometheus listeners of a local Ray (`serve_app.ray_env`) |
| 28000-29999 | Serve's direct ingress (the router replicas' own HTTP and gRPC servers; set in `ray_env`) |

Stdlib only: used by the metrics plane, the Serve glue, the simulator's launcher, benchmarks, tests.
"""

from __future__ import annotations

import random
import socket

ENGINE_PORTS = (12000, 19999)
HAPROXY_PORTS = (20000, 27999)


class NoFreePort(RuntimeError):
    """No free port (run) was found in the range after many tries."""


def free_port(host: str = "127.0.0.1", *, count: int = 1, port_range: tuple[int, int] = ENGINE_PORTS,
              rng: random.Random | None = None) -> int:
    """A TCP port in `port_range` that was free on `host` a moment ago — with `count` > 1, the first
    of `count` consecutive ones (SGLang offsets a DP rank's ports by its rank)."""
    rng = rng or random.Random()
    lo, hi = port_range
    for _ in range(200):
        port = rng.randint(lo, hi - count + 1)
        if all(_bindable(host, port + k) for k in range(count)):
            return port
    raise NoFreePort(f"no {count} consecutive free port(s) on {host} in {lo}-{hi}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
