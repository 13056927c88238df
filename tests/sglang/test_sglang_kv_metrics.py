"""SGLang's own KvMetrics publisher (its class, its socket, both IPC encodings) into kvroute: every
frame accepted by the pure decoder and by a live worker actor, with exact values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from tests.sglang.compat import has_kv_metrics_publisher, sglang  # noqa: F401

from actors.wire import decode_kv_metrics

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[2]
COUNT = 60

if not has_kv_metrics_publisher():
    pytest.skip(f"sglang {sglang.__version__}: its KvMetrics module needs a torch older than the CPU torch "
                "available here (torch._C._cpu._is_amx_tile_supported)", allow_module_level=True)


def _emit(pickle_ipc: str, *endpoints: str) -> list[dict]:
    env = {**os.environ, "SGLANG_USE_PICKLE_IPC": pickle_ipc, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.sglang._emit_kv_metrics", str(COUNT), *endpoints],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_msgpack_ipc() -> bool:
    return hasattr(__import__("sglang.srt.managers.io_struct", fromlist=["x"]), "sock_send")


@pytest.mark.parametrize("pickle_ipc", ["1", "0"])
def test_sglangs_publisher_into_the_decoder_and_a_live_worker_actor_every_frame_exact(
        ray_cluster, tmp_path, pickle_ipc):
    import ray

    from actors.fleet import parse_fleet
    from actors.worker.actor import start_worker
    from tests.integration.helpers import HealthServer, wait_for

    if pickle_ipc == "0" and not _has_msgpack_ipc():
        pytest.skip(f"sglang {sglang.__version__} sends pickle only (SGLANG_USE_PICKLE_IPC=0 arrived in 0.5.16)")
    http = HealthServer()
    raw_endpoint, actor_endpoint = f"ipc://{tmp_path}/raw", f"ipc://{tmp_path}/w.metrics"
    fleet = parse_fleet({"workers": [{"name": f"sg-metrics-{pickle_ipc}", "url": http.url,
                                      "metrics_endpoint": actor_endpoint}]})
    actor = start_worker(fleet.workers[0], fleet.settings, name_prefix="sgc-")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)  # every frame, for the pure decoder
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(raw_endpoint)
    try:
        ray.get(actor.ready.remote(), timeout=60)
        sent = _emit(pickle_ipc, raw_endpoint, actor_endpoint)
        frames = []
        while len(frames) < len(sent) and pull.poll(2000):
            frames.append(pull.recv())
        assert len(sent) == COUNT and len(frames) == COUNT
        assert [decode_kv_metrics(f).model_dump() for f in frames] == sent
        stats = wait_for(lambda: (s := ray.get(actor.stats.remote())).frames_accepted >= COUNT and s, 20,
                         what="all frames accepted by the actor")
        assert stats.frames_accepted == COUNT and stats.frames_refused == 0, stats.refused_by_reason
        assert stats.latest[0] == sent[-1]  # the newest report, every field exact
    finally:
        pull.close(linger=0)
        ctx.term()
        ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor, no_restart=True)
        http.close()
