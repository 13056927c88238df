"""Faults with real engines behind `kvroute serve`: the aggregator killed (Ray restarts it) while the
engines keep serving, untouched; an engine killed in the middle of a stream."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

pytest.importorskip("sglang", reason="the real-engine lane runs in scripts/sglang_env.sh 0.5.23's venv")

import httpx  # noqa: E402
import psutil  # noqa: E402
from openai import OpenAI  # noqa: E402

from tests.real_engine.fleet import MODEL_NAME, bring_up, overlap, shut_down, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def fleet(workdir, model_dir):
    engines, serve, startup = bring_up(workdir("faults"), model_dir)
    print(f"startup (s): {startup}")
    client = OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield {"engines": {e.name: e for e in engines}, "serve": serve, "client": client}
    shut_down(engines, serve)


def _aggregator_pid(serve) -> int:
    """The aggregator actor's process: a descendant of this kvroute serve (its own local Ray)."""
    procs = [p for p in psutil.Process(serve.proc.pid).children(recursive=True)
             if "Aggregator" in " ".join(p.cmdline() or [])]
    assert len(procs) == 1, [p.cmdline() for p in procs]
    return procs[0].pid


def _engine_pids(engine) -> set[int]:
    root = psutil.Process(engine.proc.pid)
    return {root.pid, *(c.pid for c in root.children(recursive=True))}


def _words(rng, n):
    from tests.real_engine.tiny_model import _WORDS

    return " ".join(rng.choice(_WORDS) for _ in range(n))


def test_the_aggregator_killed_routing_resumes_and_the_engines_are_untouched(fleet):
    serve, c, engines = fleet["serve"], fleet["client"], fleet["engines"]
    before = {n: _engine_pids(e) for n, e in engines.items()}
    epoch = httpx.get(f"{serve.url}/workers", timeout=10).json()["epoch"]
    agg = _aggregator_pid(serve)
    os.kill(agg, signal.SIGKILL)
    killed = time.monotonic()
    # Ray restarts it; its soft state comes back from the engines' next reports and /health probes
    wait_for(lambda: (d := httpx.get(f"{serve.url}/workers", timeout=10).json())["epoch"] != epoch
             and {w["name"]: w["state"] for w in d["workers"]} == {"w1": "live", "w2": "live"}, 60, 0.1,
             what="a new aggregator epoch with both workers live")
    whole_after = time.monotonic() - killed
    assert _aggregator_pid(serve) != agg
    served = {}
    for i in range(6):
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"after the restart {i}"}], max_tokens=4)
        assert raw.http_response.status_code == 200
        served[raw.headers["x-kvroute-worker"]] = served.get(raw.headers["x-kvroute-worker"], 0) + 1
    assert set(served) == {"w1", "w2"}, served
    # exact mode resumes: KV events reach the new aggregator's logs and the router's index
    rng = random.Random(5)
    prompt = _words(rng, 200)
    raw = c.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    first = raw.headers["x-kvroute-worker"]
    wait_for(lambda: (x := serve.route({"model": MODEL_NAME, "prompt": prompt}))["worker"] == first and overlap(x) > 0,
             15, what="the index follows KV events after the restart")
    raw2 = c.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert raw2.headers["x-kvroute-worker"] == first and raw2.parse().usage.prompt_tokens_details.cached_tokens > 0
    # the engines were never restarted or signalled: same processes, still serving
    assert {n: _engine_pids(e) for n, e in engines.items()} == before
    assert all(e.alive for e in engines.values())
    print(f"aggregator killed: whole again (new epoch, both live) after {whole_after:.2f} s")


def test_an_engine_killed_mid_stream_is_down_within_2_s_and_the_other_serves(fleet):
    serve, c, engines = fleet["serve"], fleet["client"], fleet["engines"]
    victim, other = "w2", "w1"
    progress: dict[str, dict] = {}

    def long_stream(i):
        rec = progress.setdefault(i, {"chunks": 0, "worker": None, "end": None})
        try:
            with httpx.Client(timeout=60) as hc:
                with hc.stream("POST", f"{serve.url}/v1/completions",
                               headers={"x-kvroute-policy": "round_robin"},
                               json={"model": MODEL_NAME, "prompt": f"a long story {i}", "max_tokens": 1900,
                                     "ignore_eos": True, "stream": True}) as r:
                    rec["worker"] = r.headers.get("x-kvroute-worker")
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            rec["chunks"] += 1
                    rec["end"] = "finished"
        except httpx.HTTPError as exc:  # the victim's stream breaks: that is the expected end
            rec["end"] = f"broken: {exc!r}"

    streams = []
    for i in range(4):  # round_robin: streams alternate between the two workers
        streams.append(threading.Thread(target=long_stream, args=(i,), daemon=True))
        streams[-1].start()
        wait_for(lambda: progress.get(i, {}).get("worker"), 20, what="stream headers")
    on_victim = [i for i, r in progress.items() if r["worker"] == victim]
    assert on_victim, progress
    wait_for(lambda: all(progress[i]["chunks"] > 20 for i in on_victim), 30, what="the victim streaming")
    engines[victim].kill(signal.SIGKILL)  # the server and its scheduler/detokenizer at once
    killed = time.monotonic()
    wait_for(lambda: serve.workers()[victim]["state"] == "down", 5, 0.02, what="victim down")
    down_after = time.monotonic() - killed
    for t in streams:
        t.join(timeout=60)
    for i in on_victim:
        # the victim's stream ended (broken, or closed early) well before its 1,900 tokens
        assert progress[i]["end"] is not None and progress[i]["chunks"] < 1900, progress[i]
    for i, r in progress.items():
        if r["worker"] == other:
            assert r["end"] == "finished", r  # the other worker's streams are not disturbed
    for i in range(6):
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"who serves now {i}"}], max_tokens=4)
        assert raw.http_response.status_code == 200 and raw.headers["x-kvroute-worker"] == other
    assert serve.workers()[victim]["state"] == "down"
    print(f"victim down {down_after:.2f} s after SIGKILL")
    assert down_after < 2.0, f"down after {down_after:.2f} s"
