"""`kvroute serve` with a fleet file (a managed worker, and an attach-mode one hosted by the node's
metrics host), an API key and a body limit, through the real CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import free_port

KEY = "e2e-secret-key-123"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    fleet = tmp / "fleet.yaml"
    sim_port = free_port()
    fleet.write_text(
        "workers:\n"
        "  - name: one\n    engine: sim\n    page_size: 16\n"
        f"    metrics_endpoint: ipc://{tmp}/one.metrics\n"
        "    engine_args: {time_scale: 0.2}\n"
        f"  - name: attached\n    url: http://127.0.0.1:{sim_port}\n    page_size: 16\n"
        f"    metrics_endpoint: ipc://{tmp}/attached.metrics\n"
    )
    port = free_port()
    while port == sim_port:  # free_port() releases the port it found: pick both before the sim binds one
        port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "sim", "--port", str(sim_port), "--metrics-endpoint",
                            f"ipc://{tmp}/attached.metrics", "--time-scale", "0.2"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the attach worker is up before kvroute serve probes it
        try:
            if httpx.get(f"http://127.0.0.1:{sim_port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KVROUTE_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve_app.cli", "serve", "--fleet", str(fleet), "--port", str(port),
         "--api-key", KEY, "--max-body-bytes", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    out = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        out.append(line)
        if "kvroute status --url" in line:
            break
    assert any("listening on" in ln for ln in out), "".join(out)[-3000:]
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "out": out}
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
    sim.terminate()
    sim.wait(timeout=10)


def test_every_route_but_healthz_needs_the_key(served):
    url = served["url"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    for method, path in (("GET", "/workers"), ("POST", "/v1/chat/completions"), ("POST", "/route"),
                         ("GET", "/metrics"), ("GET", "/v1/models")):
        r = httpx.request(method, f"{url}{path}", json=body if method == "POST" else None, timeout=10)
        assert r.status_code == 401, (path, r.status_code)
        assert KEY not in r.text
    ok = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.headers["x-kvroute-worker"] == "one"


def test_the_attach_worker_is_served_through_its_nodes_host_the_aggregator(served):
    url, auth = served["url"], {"authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {w["name"]: w["state"] for w in httpx.get(f"{url}/workers", headers=auth, timeout=10).json()["workers"]}
        if states.get("attached") in ("idle", "live"):
            break
        time.sleep(0.2)
    assert states.get("attached") in ("idle", "live"), states
    assert any("worker attached: metrics on" in ln for ln in served["out"])
    from sim.config import SimConfig

    # the attach sim serves its own model name (its /v1/models); the managed `one` declares none (any)
    body = {"model": SimConfig().model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    hit = set()
    for _ in range(12):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={**auth, "x-kvroute-policy": "round_robin"},
                       timeout=60)
        assert r.status_code == 200
        hit.add(r.headers["x-kvroute-worker"])
    assert hit == {"one", "attached"}


def test_bodies_above_the_limit_get_413(served):
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{served['url']}/v1/chat/completions", json=big, headers={"authorization": f"Bearer {KEY}"},
                   timeout=10)
    assert r.status_code == 413 and "2000" in r.json()["error"]["message"]


def test_the_key_is_never_printed(served):
    assert KEY not in "".join(served["out"])
