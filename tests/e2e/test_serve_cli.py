"""`kvroute serve` with a managed fleet file, an API key and a body limit, through the real CLI."""

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
    fleet.write_text(
        "workers:\n"
        "  - name: one\n    engine: sim\n    page_size: 16\n"
        f"    metrics_endpoint: ipc://{tmp}/one.metrics\n"
        "    engine_args: {time_scale: 0.2}\n"
    )
    port = free_port()
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


def test_bodies_above_the_limit_get_413(served):
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{served['url']}/v1/chat/completions", json=big, headers={"authorization": f"Bearer {KEY}"},
                   timeout=10)
    assert r.status_code == 413 and "2000" in r.json()["error"]["message"]


def test_the_key_is_never_printed(served):
    assert KEY not in "".join(served["out"])
