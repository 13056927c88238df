"""`engine: sglang` managed workers through `kvroute serve`, with kvroute's default settings: each
worker's actor launches SGLang 0.5.23's real server in SGLang's own Python (the fleet entry's
`python`) with the entry's `env:` (the CPU engine), its metrics address fixed by kvroute and its
KV events met by the actor; both workers stay live — never flapping on SGLang's >= 1 s /health —
while they idle and serve; a killed engine is restarted by its actor."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

pytest.importorskip("sglang", reason="the real-engine lane runs in scripts/sglang_env.sh 0.5.23's venv")

import httpx  # noqa: E402

from tests.real_engine.engines import CPU_KERNELS, MAX_RUNNING, MAX_TOTAL_TOKENS, PAGE_SIZE  # noqa: E402
from tests.real_engine.fleet import KvrouteServe, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def managed(workdir, model_dir):
    tmp = workdir("managed")
    engine_args = {"device": "cpu", "dtype": "float32", "attention_backend": "torch_native",
                   "disable_overlap_schedule": True, "max_total_tokens": MAX_TOTAL_TOKENS,
                   "max_running_requests": MAX_RUNNING, "mem_fraction_static": 0.05,
                   "sleep_on_idle": True, "served_model_name": "tiny"}
    env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(CPU_KERNELS),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    workers = [{"name": f"m{i}", "engine": "sglang", "model": str(model_dir), "python": sys.executable,
                "env": env, "page_size": PAGE_SIZE, "kv_events_endpoint": "auto",
                "metrics_endpoint": f"ipc://{tmp}/m{i}.metrics", "engine_args": engine_args} for i in range(2)]
    fleet = {"workers": workers, "router": {"tokenizer": f"hf:{model_dir}", "block_size": PAGE_SIZE}}
    fleet_file = tmp / "fleet.yaml"
    fleet_file.write_text(json.dumps(fleet))  # YAML is a superset of JSON
    serve = KvrouteServe(fleet_file, tmp).start()
    try:
        serve.wait_listening(timeout_s=900)  # kvroute serve waits for both engines' /health
        serve.wait_workers(lambda ws: set(ws) == {"m0", "m1"} and all(w["state"] != "down" for w in ws.values()),
                           60, what="both managed workers up")
    except BaseException:
        serve.stop()
        raise
    yield serve
    serve.stop()


def _engine_pid(serve, name: str) -> int:
    return serve.workers()[name]["managed"]["pid"]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return {k.decode(): v.decode() for k, _, v in (kv.partition(b"=") for kv in f.read().split(b"\0")) if k}


def test_each_actor_runs_the_real_server_in_the_python_and_env_its_entry_names(managed):
    for name in ("m0", "m1"):
        pid = _engine_pid(managed, name)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[0].decode() == sys.executable and b"actors.sglang_launch" in argv
        env = _environ(pid)
        assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert env["KVROUTE_METRICS_IPC_NAME"] == f"ipc://{managed.fleet_file.parent}/{name}.metrics"
        from tests.real_engine.engines import REPO

        # kvroute's source first (actors.sglang_launch), then the entry's own PYTHONPATH
        assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(REPO), str(CPU_KERNELS)]


def test_default_settings_never_flap_the_workers_while_they_idle_and_serve(managed):
    """The bug of issue 31: with a 1 s probe timeout against SGLang's >= 1 s /health, both workers went
    down every few seconds and 3-13 of 30 requests got 503."""
    states: list[tuple[str, str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                states.extend((n, w["state"]) for n, w in managed.workers().items())
            except httpx.HTTPError:
                states.append(("?", "unreachable"))
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    codes = []
    try:
        time.sleep(12.0)  # idle past a confirmation period (health_check_interval_s 10 s)
        with httpx.Client(base_url=managed.url, timeout=120) as c:
            for i in range(30):
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"river {i} stone " * 20,
                                                    "max_tokens": 4, "temperature": 0})
                codes.append(r.status_code)
        time.sleep(3.0)
    finally:
        stop.set()
        t.join()
    assert codes == [200] * 30
    downs = [s for s in states if s[1] in ("down", "unreachable")]
    assert len(states) > 100 and downs == [], f"{len(downs)} of {len(states)} samples down"
    heartbeat = [w["heartbeat_age_s"] for w in managed.workers().values()]
    assert max(heartbeat) < 1.5, heartbeat  # heartbeats reach the router while nothing else changes


def test_a_killed_managed_engine_is_down_within_2s_and_restarted_by_its_actor(managed):
    import signal

    pid = _engine_pid(managed, "m1")
    os.killpg(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: managed.workers()["m1"]["state"] == "down", 10, interval_s=0.05, what="m1 down")
    assert time.monotonic() - killed <= 2.0
    with httpx.Client(base_url=managed.url, timeout=120) as c:  # the other serves meanwhile
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "while m1 restarts", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] == "m0"
    wait_for(lambda: (w := managed.workers()["m1"])["state"] != "down" and w["managed"]["pid"] != pid, 600,
             interval_s=0.5, what="m1's engine restarted by its actor")
    assert managed.workers()["m1"]["managed"]["restarts"] == 1
