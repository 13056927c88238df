"""Every wire form, sent by a living simulated SGLang worker, is decoded by its (managed) worker actor."""

from __future__ import annotations

import httpx
import pytest

from actors.fleet import parse_fleet
from sim.sglang_shapes import WIRE_FORMS
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray

FORMS = sorted(WIRE_FORMS)


@pytest.fixture(scope="module")
def managed(ray_cluster, tmp_path_factory):
    import ray

    from actors.worker.actor import start_worker

    tmp = tmp_path_factory.mktemp("wire")
    fleet = parse_fleet({"workers": [
        {"name": f"form-{i}", "engine": "sim", "page_size": 16, "metrics_endpoint": f"ipc://{tmp}/f{i}.metrics",
         "engine_args": {"wire": form, "time_scale": 0.05, "max_running_requests": 32}}
        for i, form in enumerate(FORMS)
    ]})
    actors = {w.name: start_worker(w, fleet.settings, name_prefix="wire-") for w in fleet.workers}
    infos = dict(zip(actors, ray.get([a.ready.remote() for a in actors.values()], timeout=120)))
    yield actors, infos
    ray.get([a.stop.remote() for a in actors.values()], timeout=30)
    for a in actors.values():
        ray.kill(a, no_restart=True)


@pytest.mark.parametrize("i, form", list(enumerate(FORMS)))
def test_a_simulated_worker_sending_this_form_is_decoded_by_its_actor(managed, i, form):
    import ray

    actors, infos = managed
    name = f"form-{i}"
    r = httpx.post(f"{infos[name].url}/v1/completions",
                   json={"model": "m", "prompt": "the quick brown fox " * 20, "max_tokens": 45}, timeout=30)
    assert r.status_code == 200
    stats = wait_for(lambda: (s := ray.get(actors[name].stats.remote())).frames_accepted >= 2 and s, 10,
                     what=f"{form} frames accepted")
    assert stats.frames_refused == 0, stats.refused_by_reason
    latest = stats.latest[0]
    assert latest["request_total_slots"] == 32  # the sim's max_running_requests, as SGLang reports it
    assert latest["kv_total_blocks"] > 0


def test_managed_workers_report_their_process(managed):
    _, infos = managed
    for info in infos.values():
        assert info.managed.process == "running" and info.managed.pid > 0
        assert httpx.get(f"{info.url}/health", timeout=5).status_code == 200
