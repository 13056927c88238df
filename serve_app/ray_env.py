"""The Ray Serve transport kvroute runs with: proxy → router replica over gRPC.

By default Ray Serve's HTTP proxy hands every request to a replica as a Ray actor call and every
streamed SSE chunk comes back as a Ray object. Ray 2.60 can carry that hop over a direct gRPC
channel instead (part of its "throughput optimized" mode). Measured with 4 simulated workers at
8 concurrent requests (`python -m bench.serve_transport`, `bench/results/serve-transport.md`): the
proxy and the replica together use 0.79× the CPU per streamed 12-token reply (0.73–0.88× across
request kinds), which on a loaded box is latency and per replica is throughput.

These are *process environment* settings: the Serve controller, the proxy and the replicas read
them when they start, so they must be the same on every node before `ray start` (cluster.yaml's
`run_options`, the KubeRay pod env) — kvroute sets them itself only when it starts a local Ray.
Setting any of them in the environment beforehand wins (`RAY_SERVE_USE_GRPC_BY_DEFAULT=0
RAY_SERVE_PROXY_USE_GRPC=0` restores Ray's actor-call transport).

Not enabled: Ray's direct ingress (`RAY_SERVE_ENABLE_DIRECT_INGRESS`), which buffered SSE streams
in our tests.
"""

from __future__ import annotations

import os
from typing import MutableMapping

# gRPC refuses a message above this size; the proxy → replica message carries the request's headers
# (uvicorn bounds none; the router answers 431 above `max_header_bytes`) and bodies up to
# `max_body_bytes` must reach the router to get their 413, so it is far above both.
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",  # controller + handles: replicas serve gRPC
    "RAY_SERVE_PROXY_USE_GRPC": "1",  # the HTTP proxy calls replicas over gRPC
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES),
}


def apply_serve_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set kvroute's Serve transport in `environ` where not already set (call before a local
    `ray.init`: Ray's processes inherit it). Returns the values now in effect."""
    for k, v in SERVE_ENV.items():
        environ.setdefault(k, v)
    return {k: environ[k] for k in SERVE_ENV}
