"""The dynamo-kv benchmark target: Dynamo 1.6.1's SelectionService over real simulated workers.

Three sims publish SGLang 0.5.23 KV events on bound PUBs (as bench.targets starts them); the proxy
(`bench.dynamo_kv`) runs in this process with a real `dynamo.llm.SelectionService` subscribed to
them. No network beyond loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

dynamo_llm = pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime (the bench extra) is not installed")

from bench.dynamo_kv import DynamoProxy, build_app, variant_env, worker_record  # noqa: E402
from tests.conftest import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16
POOL = 12288


@pytest.fixture(scope="module")
def sims():
    """Three simulated workers (time scale 0.2: a 2k-token prefill takes ~25 ms), KV events on."""
    procs, workers = [], []
    for i in range(3):
        port, kv, replay = free_port(), free_port(), free_port()
        cfg = {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://127.0.0.1:{kv}", "bind": True,
               "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        argv = [sys.executable, "-m", "sim", "--port", str(port), "--page-size", str(PAGE), "--time-scale", "0.2",
                "--max-total-num-tokens", str(POOL), "--kv-events-config", json.dumps(cfg)]
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)}))
        workers.append({"name": f"sim-{i}", "url": f"http://127.0.0.1:{port}", "page_size": PAGE,
                        "total_kv_blocks": POOL // PAGE, "max_num_batched_tokens": 16384,
                        "kv_events_endpoint": cfg["endpoint"], "kv_events_replay_endpoint": cfg["replay_endpoint"]})
    try:
        deadline = time.monotonic() + 60
        for w in workers:
            while True:
                try:
                    if httpx.get(w["url"] + "/health", timeout=0.5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"{w['name']} never became healthy"
                time.sleep(0.05)
        yield workers
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
async def proxy(sims):
    from aiohttp import web

    for w in sims:
        httpx.post(w["url"] + "/flush_cache", timeout=5)
    p = DynamoProxy("dynamo-kv-test", sims, 0.05)
    runner = web.AppRunner(build_app(p))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.sleep(0.3)  # the service's SUBs connect to the PUBs
    try:
        yield p, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i % 97}" for i in range(n))


async def _chat(client: httpx.AsyncClient, url: str, system: str, question: str) -> tuple[str, int]:
    """One streamed chat request through the proxy: (worker, cached prompt tokens)."""
    body = {"model": "default", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    cached = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        worker = r.headers["x-bench-worker"]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached is not None
    return worker, cached


async def test_repeated_prefix_goes_to_the_worker_holding_it(proxy):
    p, url = proxy
    system = _words("sys", 1200)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        first, cached = await _chat(c, url, system, "first question")
        assert cached == 0
        await asyncio.sleep(0.3)  # its BlockStored events reach the service
        # in flight together: without the overlap they would spread like the cold burst below
        later = await asyncio.gather(*(_chat(c, url, system, f"question number {k}") for k in range(3)))
    assert {w for w, _ in later} == {first}
    assert all(cached >= 1100 for _, cached in later), later  # the engine really served it from cache
    for _ in range(40):  # each reservation is freed as its handler ends, just after the client saw the end
        loads = p.svc.loads(model_name="default")[0]["loads"]
        if all(x["active_requests"] == 0 for x in loads):
            break
        await asyncio.sleep(0.05)
    assert all(x["active_requests"] == 0 for x in loads), loads  # every reservation freed


async def test_cold_prompts_in_flight_together_spread_over_the_workers(proxy):
    p, url = proxy
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        got = await asyncio.gather(*(_chat(c, url, _words(f"cold{k}x", 1500), "q") for k in range(3)))
    assert sorted(w for w, _ in got) == ["sim-0", "sim-1", "sim-2"]  # the reservations booked each one's load


async def test_every_field_sent_is_one_the_service_knows(proxy, sims):
    """1.6.1 accepts unknown JSON keys silently: its catalog record must echo each field we set."""
    p, _ = proxy
    for i, (sent, rec) in enumerate(zip((worker_record(i, w) for i, w in enumerate(sims)), p.records)):
        for k, v in sent.items():
            assert rec[k] == v, (k, rec.get(k), v)


def test_each_variant_changes_only_what_it_names():
    assert variant_env("dynamo-kv") == {"DYN_LOG": "warn"}
    assert variant_env("dynamo-kv-load")["DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT"] == "0"
    assert variant_env("dynamo-kv-approx")["DYN_ROUTER_USE_KV_EVENTS"] == "false"
