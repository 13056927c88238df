"""Binding a worker's metrics PULL — where SGLang's scheduler connects its KvMetrics PUSH — with
clear errors naming the worker and the endpoint. Used by every process that receives a worker's
metrics (its worker actor, or a Serve LLM replica's collector). No Ray import."""

from __future__ import annotations

import errno
import os
import socket

import zmq
import zmq.asyncio

_HARD_MSG_LIMIT_FACTOR = 16  # ZMQ drops peers sending above this × max_frame_bytes (memory bound)


class EndpointError(RuntimeError):
    """The worker's metrics endpoint cannot be bound (busy, bad path, no permission)."""


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def _ipc_in_use(path: str) -> bool:
    """True if a live process listens on this ipc path (a stale file is not 'in use')."""
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.2)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def default_endpoint(name: str) -> str:
    """A managed worker's metrics endpoint when its spec gives none: a node-local ipc:// path named
    after the worker and the process that binds it (SGLang's own default is random)."""
    import tempfile

    return f"ipc://{tempfile.gettempdir()}/kvroute-{name}-{os.getpid()}.metrics"


def bind_pull(ctx: zmq.asyncio.Context, name: str, endpoint: str, max_frame_bytes: int) -> zmq.asyncio.Socket:
    """Bind a PULL socket like the seed's loop; clear errors naming worker and endpoint."""
    path = _ipc_path(endpoint)
    if path is not None:
        if _ipc_in_use(path):
            raise EndpointError(
                f"worker {name}: metrics endpoint {endpoint} is busy (another process is bound to it); "
                "choose another path or stop that process"
            )
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            raise EndpointError(f"worker {name}: metrics endpoint {endpoint}: directory {parent} does not exist")
        if os.path.exists(path):
            os.unlink(path)  # stale file from a dead process
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes * _HARD_MSG_LIMIT_FACTOR)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        hint = " (address in use)" if exc.errno == errno.EADDRINUSE else ""
        raise EndpointError(f"worker {name}: cannot bind metrics endpoint {endpoint}: {exc}{hint}") from None
    return sock
