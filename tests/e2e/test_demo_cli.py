"""The README's main job, end to end: the real `kvroute demo` CLI in a subprocess, the real
`openai` client through the router, metrics from the simulated schedulers, then Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from tests.conftest import free_port
from tests.integration.helpers import wait_for


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


@pytest.fixture(scope="module")
def demo():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve_app.cli", "demo", "--workers", "3", "--port", str(port), "--no-table",
         "--time-scale", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "kvroute status --url" in line:
            break
    else:
        proc.kill()
    assert any("kvroute is listening on" in ln for ln in lines), "".join(lines)[-3000:]
    yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "banner": "".join(lines)}
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_demo_prints_url_curl_and_sdk_snippet(demo):
    b = demo["banner"]
    assert demo["url"] in b and "curl -s" in b and "from openai import OpenAI" in b
    assert "starting 3 worker actor(s)" in b


def test_openai_client_chat_through_the_router_streaming_and_not(demo):
    client = OpenAI(base_url=f"{demo['url']}/v1", api_key="unused", timeout=60, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": "Hello from the e2e test"}], max_tokens=8
    )
    resp = raw.parse()
    assert raw.headers["x-kvroute-worker"].startswith("sim-")
    assert resp.usage.completion_tokens == 8 and resp.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Stream please"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 6
    completion = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5)
    assert completion.usage.completion_tokens == 5
    assert client.models.list().data


def test_metrics_from_the_simulated_schedulers_arrive_in_workers(demo):
    url = demo["url"]
    with httpx.Client(timeout=30) as c:
        for i in range(6):
            c.post(f"{url}/v1/completions", json={"model": "m", "prompt": f"prompt {i} " * 50, "max_tokens": 4})
        data = wait_for(
            lambda: (d := c.get(f"{url}/workers").json()) and sum(1 for w in d["workers"] if w["metrics"]) >= 2 and d,
            20, what="metrics from at least two simulated schedulers",
        )
    assert len(data["workers"]) == 3
    reported = [w for w in data["workers"] if w["metrics"]]
    for w in reported:
        assert w["metrics"]["request_total_slots"] > 0 and w["metrics"]["kv_total_blocks"] > 0
        assert w["state"] in ("live", "idle") and w["managed"]["process"] == "running"
    demo["worker_urls"] = [w["url"] for w in data["workers"]]


def test_ctrl_c_exits_cleanly_and_leaves_no_worker_listening(demo):
    proc, urls = demo["proc"], demo.get("worker_urls")
    if urls is None:
        urls = [w["url"] for w in httpx.get(f"{demo['url']}/workers", timeout=10).json()["workers"]]
    assert all(_listening(u) for u in urls)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=40)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, out[-2000:]
    assert elapsed < 20, f"Ctrl-C took {elapsed:.1f} s"
    assert "kvroute: stopped" in out
    assert not any(_listening(u) for u in urls)
    assert not _listening(demo["url"])
