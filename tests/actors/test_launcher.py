"""A managed engine under its keeper (`actors.launcher.ManagedProcess`, `actors.keeper`), with real
simulated SGLang engine processes and real owner processes killed with SIGKILL: launched and healthy,
restarted when it dies, stopped with its worker, adopted by a restarted owner within the grace, and
stopped when no owner comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from actors.fleet import WorkerSpec
from actors.launcher import LaunchError, ManagedProcess

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


def test_an_engine_runs_under_its_keeper_is_restarted_when_it_dies_and_stopped_with_its_worker(tmp_path):
    async def run():
        p = _proc(tmp_path, "kp-a")
        await p.start()
        await p.wait_healthy()
        first = p.status.pid
        assert p.alive and _alive(first) and p.status.state == "running"
        keeper = _ppid(first)  # the engine's parent is its keeper, which is detached: not our child (a Ray
        # worker kills its children when it exits) — so the engine can outlive its owner
        with open(f"/proc/{keeper}/cmdline", "rb") as f:
            assert b"actors.keeper" in f.read()
        assert keeper != os.getpid() and _ppid(keeper) != os.getpid()
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
from actors.launcher import ManagedProcess
async def main():
    p = ManagedProcess(WorkerSpec(name=sys.argv[1], engine="sim", engine_args={"time_scale": 0.25}),
                       metrics_endpoint=sys.argv[2], orphan_grace_s=float(sys.argv[3]))
    await p.start()
    await p.wait_healthy()
    print(json.dumps({"control": p.control, "port": p.port, "pid": p.status.pid}), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def _owner(tmp_path, name: str, grace_s: float) -> tuple[subprocess.Popen, dict]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, name, f"ipc://{tmp_path}/{name}.metrics", str(grace_s)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = owner.stdout.readline()
    assert line, "the owner process printed nothing"
    return owner, json.loads(line)


def test_a_restarted_owner_adopts_the_engine_its_previous_incarnation_launched(tmp_path):
    owner, rec = _owner(tmp_path, "kp-adopt", grace_s=30)
    owner.kill()  # the owner's actor dies (SIGKILL: nothing runs in it)
    owner.wait()
    time.sleep(0.5)
    assert _alive(rec["pid"]), "the engine died with its owner despite the grace"

    async def run():
        p = _proc(tmp_path, "kp-adopt", port=rec["port"], control=rec["control"])
        await p.start()
        await p.wait_healthy()
        assert p.adopted and p.status.pid == rec["pid"] and p.status.state == "running"
        assert httpx.get(f"{p.url}/health", timeout=5).status_code == 200
        await p.stop()

    asyncio.run(run())
    _wait(lambda: not _alive(rec["pid"]), 10, "the adopted engine stopped by its new owner")
    assert not os.path.exists(rec["control"])


def test_an_engine_nobody_adopts_is_stopped_after_the_grace(tmp_path):
    owner, rec = _owner(tmp_path, "kp-orphan", grace_s=1.0)
    owner.kill()
    owner.wait()
    killed = time.monotonic()
    _wait(lambda: not _alive(rec["pid"]), 10, "the orphaned engine stopped")
    assert time.monotonic() - killed >= 0.9  # not before the grace

    async def run():  # its keeper is gone too: a late owner launches a new engine instead
        p = _proc(tmp_path, "kp-orphan", control=rec["control"])
        await p.start()
        await p.wait_healthy()
        assert not p.adopted and p.status.pid != rec["pid"]
        await p.stop()

    asyncio.run(run())


def test_the_keepers_socket_is_private_and_takes_no_commands_but_stop(tmp_path):
    owner, rec = _owner(tmp_path, "kp-sock", grace_s=0)
    try:
        assert os.stat(os.path.dirname(rec["control"])).st_mode & 0o777 == 0o700
        assert os.stat(rec["control"]).st_mode & 0o777 == 0o600
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.connect(rec["control"])
        assert json.loads(s.makefile().readline())["pid"] == rec["pid"]
        s.sendall(b"__import__('os').system('touch /tmp/kvroute-pwned')\nrestart\n\x00\xff\n")
        time.sleep(0.3)
        assert _alive(rec["pid"]) and not os.path.exists("/tmp/kvroute-pwned")
        s.close()
    finally:
        owner.kill()
        owner.wait()
    _wait(lambda: not _alive(rec["pid"]), 10, "the engine stopped at once (grace 0) when its owner died")
