"""A managed engine as its worker actor's child (`actors.worker.launcher.ManagedProcess`), with real
simulated SGLang engine processes and real owner processes killed with SIGKILL: launched and healthy,
restarted when it dies, stopped with its worker, gone with an owner that dies (no orphan), and started
with the fleet entry's environment and Python."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from actors.fleet import WorkerSpec
from actors.worker.launcher import LaunchError, ManagedProcess

SPEC = {"engine": "sim", "engine_args": {"time_scale": 0.25}}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _proc(tmp_path, name: str, **kw) -> ManagedProcess:
    return ManagedProcess(WorkerSpec(name=name, **SPEC), metrics_endpoint=f"ipc://{tmp_path}/{name}.metrics", **kw)


def test_an_engine_is_its_owners_child_is_restarted_when_it_dies_and_stopped_with_its_worker(tmp_path):
    async def run():
        p = _proc(tmp_path, "kp-a")
        await p.start()
        await p.wait_healthy()
        first = p.status.pid
        assert p.alive and _alive(first) and p.status.state == "running"
        assert _ppid(first) == os.getpid()  # no process in between
        os.kill(first, signal.SIGKILL)
        for _ in range(200):
            await asyncio.sleep(0.05)
            if p.status.state == "running" and p.status.restarts == 1:
                break
        assert p.status.restarts == 1 and p.status.pid != first and p.status.last_exit == -signal.SIGKILL
        second = p.status.pid
        await p.stop()
        assert p.status.state == "stopped" and not p.alive
        return second

    pid = asyncio.run(run())
    _wait(lambda: not _alive(pid), 5, "the stopped engine gone")


def test_an_engine_that_never_becomes_healthy_is_reported(tmp_path):
    async def run():
        p = ManagedProcess(WorkerSpec(name="kp-bad", engine="sim", engine_args={"no_such_flag": 1}),
                           metrics_endpoint=f"ipc://{tmp_path}/bad.metrics", max_restarts=0, health_timeout_s=20)
        await p.start()
        with pytest.raises(LaunchError, match="engine exited"):
            await p.wait_healthy()
        await p.stop()

    asyncio.run(run())


OWNER = """
import asyncio, json, sys
from actors.fleet import WorkerSpec
from actors.worker.launcher import ManagedProcess
async def main():
    p = ManagedProcess(WorkerSpec(name=sys.argv[1], engine="sim", engine_args={"time_scale": 0.25}),
                       metrics_endpoint=sys.argv[2])
    await p.start()
    await p.wait_healthy()
    print(json.dumps({"port": p.port, "pid": p.status.pid}), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_an_engine_dies_with_an_owner_that_is_killed_so_a_restarted_actor_meets_no_orphan(tmp_path):
    """SIGKILL of the owner (a crashed worker actor: nothing runs in it) takes its engine with it, and its
    port is free again for the engine the restarted actor launches."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "kp-orphan", f"ipc://{tmp_path}/kp-orphan.metrics"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = owner.stdout.readline()
    assert line, "the owner process printed nothing"
    rec = json.loads(line)
    assert _alive(rec["pid"])
    owner.kill()
    owner.wait()
    _wait(lambda: not _alive(rec["pid"]), 5, "the dead owner's engine gone")

    async def run():
        p = _proc(tmp_path, "kp-orphan", port=rec["port"])
        await p.start()
        await p.wait_healthy()  # the same port: nothing held it
        assert p.status.pid != rec["pid"]
        await p.stop()

    asyncio.run(run())


def test_the_fleet_entrys_env_reaches_the_engine(tmp_path):
    spec = WorkerSpec(name="kp-env", engine="sim", engine_args={"time_scale": 0.25},
                      env={"OMP_NUM_THREADS": "1"})

    async def run():
        p = ManagedProcess(spec, metrics_endpoint=f"ipc://{tmp_path}/kp-env.metrics")
        await p.start()
        await p.wait_healthy()
        with open(f"/proc/{p.status.pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        await p.stop()
        return env

    env = asyncio.run(run())
    assert env[b"OMP_NUM_THREADS"] == b"1"


def test_an_sglang_entry_runs_in_the_python_it_names_with_kvroutes_source_on_its_path(tmp_path):
    from actors.worker.launcher import SGLANG_METRICS_ENV, build_command

    spec = WorkerSpec(name="sg", engine="sglang", model="/models/tiny", python="/opt/sglang/bin/python",
                      env={"SGLANG_USE_CPU_ENGINE": "1"})
    cmd, extra = build_command(spec, host="127.0.0.1", port=30001, metrics_endpoint="ipc:///tmp/sg.metrics")
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "actors.sglang_launch"]
    assert "--enable-cache-report" in cmd  # the engine reports cached_tokens, which kvroute checks
    off = spec.model_copy(update={"engine_args": {"enable_cache_report": False}})
    assert "--enable-cache-report" not in build_command(off, host="127.0.0.1", port=1, metrics_endpoint="ipc:///x")[0]
    import actors

    root = os.path.dirname(os.path.dirname(actors.__file__))
    assert extra[SGLANG_METRICS_ENV] == "ipc:///tmp/sg.metrics"
    assert extra["PYTHONPATH"].split(os.pathsep)[0] == root
    # the entry's own PYTHONPATH (e.g. a kernel stand-in) follows kvroute's source, not replaced by it
    with_path = spec.model_copy(update={"env": {"PYTHONPATH": "/opt/extra"}})
    _, extra = build_command(with_path, host="127.0.0.1", port=30001, metrics_endpoint="ipc:///tmp/sg.metrics")
    assert extra["PYTHONPATH"] == os.pathsep.join([root, "/opt/extra"])
    # without `python`: kvroute's own interpreter, which has kvroute installed (no PYTHONPATH needed)
    cmd, extra = build_command(spec.model_copy(update={"python": None}), host="127.0.0.1", port=30001,
                               metrics_endpoint="ipc:///tmp/sg.metrics")
    assert cmd[0] == sys.executable and "PYTHONPATH" not in extra


def test_env_and_python_are_refused_where_kvroute_starts_no_engine_or_would_clobber_its_own():
    from actors.fleet import FleetError, parse_fleet

    attach = {"name": "a", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/a.m"}
    with pytest.raises(FleetError, match="env and python are for managed mode"):
        parse_fleet({"workers": [{**attach, "env": {"X": "1"}}]})
    with pytest.raises(FleetError, match="python is for engine: sglang"):
        parse_fleet({"workers": [{"name": "s", "engine": "sim", "python": "/usr/bin/python3"}]})
    with pytest.raises(FleetError, match="KVROUTE_METRICS_IPC_NAME: set by kvroute"):
        parse_fleet({"workers": [{"name": "s", "engine": "sim", "env": {"KVROUTE_METRICS_IPC_NAME": "x"}}]})
    with pytest.raises(FleetError, match="CUDA_VISIBLE_DEVICES: set by kvroute"):
        parse_fleet({"workers": [{"name": "s", "engine": "sim", "env": {"CUDA_VISIBLE_DEVICES": "0"}}]})
    with pytest.raises(FleetError, match="environment variable name"):
        parse_fleet({"workers": [{"name": "s", "engine": "sim", "env": {"A B": "0"}}]})
