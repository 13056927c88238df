"""Test helpers: a controllable /health server and polling utilities."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


class HealthServer:
    """A stand-in worker HTTP surface for metrics-plane tests: `/health` (the confirmation) and
    `/v1/models` (the liveness probe) answer 200 — `/v1/models` listing model "m" — or 503 once
    `healthy` is False."""

    def __init__(self) -> None:
        self.healthy = True
        self.probes = 0  # liveness probes (/v1/models) answered
        self.confirmations = 0  # /health requests answered
        self._conns: set = set()
        self._closed = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as SGLang's uvicorn server: probes reuse their connection

            def setup(self):
                super().setup()
                outer._conns.add(self.connection)

            def do_GET(self):  # noqa: N802
                body = b""
                if self.path == "/health":
                    outer.confirmations += 1
                elif self.path == "/v1/models":
                    outer.probes += 1
                    body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
                known = self.path in ("/health", "/v1/models")
                self.send_response(200 if known and outer.healthy else 503 if known else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Gone, as a dead worker's server is: the listener and every kept-alive connection closed."""
        if self._closed:
            return
        self._closed = True
        self.server.shutdown()
        self.server.server_close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    """Poll until `predicate()` is truthy; returns its value or fails with `what`."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing polled may not be up yet
            last_exc = exc
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def reregistered(view: dict, names, epoch: str, since_wall: float) -> bool:
    """Whether a router's `/workers` view (`view`, its JSON) is of aggregator `epoch` and holds every
    worker in `names` as applied after `since_wall` (wall clock): re-registered with a restarted
    aggregator. A router carries the workers a restarted aggregator's first snapshot lacks for a
    grace (`resync_grace_s`), so their presence alone does not show they came back."""
    if view["epoch"] != epoch:
        return False
    at = {w["name"]: w["updated_at"] for w in view["workers"] if w["state"] != "down"}
    return all(at.get(n, 0.0) >= since_wall for n in names)


class BrokenWorker:
    """A worker whose /health and /v1/models are fine but which answers every POST with `status`
    (counts them)."""

    def __init__(self, status: int = 500) -> None:
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as SGLang's uvicorn server: probes reuse their connection

            def do_GET(self):  # noqa: N802
                body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}' \
                    if self.path == "/v1/models" else b""
                self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                outer.posts += 1
                length = int(self.headers.get("content-length", 0))
                self.rfile.read(length)
                body = b'{"error": "broken on purpose"}'
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def pd_pair_app(tag: str, serve_port: int, tmp, dp_size: int = 1):
    """A prefill and a decode sim (`{tag}-prefill`, `{tag}-decode`, model `{tag}-model`, `dp_size`
    ranks each) as managed workers behind kvroute's Serve app at `/{tag}`; yields (client, fleet)
    once both are up with their roles, and removes everything after."""
    import httpx
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.fleet import parse_fleet
    from actors.worker.actor import start_worker
    from serve_app.app import build_app
    from sim.launch import free_port

    names = {f"{tag}-prefill": "prefill", f"{tag}-decode": "decode"}
    sim = {"engine": "sim", "page_size": 16, "model": f"{tag}-model", "engine_args": {"time_scale": 0.05},
           **({"dp_size": dp_size} if dp_size > 1 else {})}
    fleet = parse_fleet({"workers": [
        {"name": f"{tag}-prefill", "role": "prefill", "bootstrap_port": free_port(),
         "metrics_endpoint": f"ipc://{tmp}/p.metrics", **sim},
        {"name": f"{tag}-decode", "role": "decode", "metrics_endpoint": f"ipc://{tmp}/d.metrics", **sim},
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix=f"{tag}-") for w in fleet.workers}
    ray.get([a.ready.remote() for a in actors.values()], timeout=120)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "router": {"policy": "kv_aware"}}),
              name=tag, route_prefix=f"/{tag}")
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}/{tag}", timeout=60)
    try:
        wait_for(lambda: {(w["name"], w["role"], w["dp_size"]) for w in client.get("/workers").json()["workers"]
                          if w["name"] in names and w["state"] != "down"}
                 == {(n, role, dp_size) for n, role in names.items()},
                 60, what=f"both PD workers up with their roles and {dp_size} rank(s)")
        yield client, fleet
    finally:
        client.close()
        serve.delete(tag)
        ray.get([a.stop.remote() for a in actors.values()], timeout=30)
        for a in actors.values():
            ray.kill(a, no_restart=True)
        agg = get_or_create_aggregator(fleet.settings)
        ray.get([agg.remove.remote(n) for n in names], timeout=30)


def wait_for_chat(base: str, model: str, timeout_s: float = 240) -> None:
    """Until `base`/v1/chat/completions answers a 2-token chat for `model` with 200 (a Serve app
    whose replicas are still starting refuses or errors meanwhile)."""
    import httpx

    def ready() -> bool:
        try:
            r = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
                "model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    wait_for(ready, timeout_s, interval_s=1.0, what=f"{base} answering a chat for {model}")
