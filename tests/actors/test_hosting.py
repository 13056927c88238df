"""actors.hosting: the host role written once — here inside a stand-in for the aggregator, its frames
going in-process (`LocalLink`) into a real `FleetRegistry`, from real SGLang frames on real PULLs and a
real /health server; and passive liveness (`HealthProbe.due`). No Ray."""

from __future__ import annotations

import asyncio
import time

import httpx
import zmq
import zmq.asyncio

from actors.fleet import WorkerSpec
from actors.health import HealthProbe
from actors.hosting import LocalLink, NodeHosting
from actors.models import Settings
from actors.registry import FleetRegistry
from sim.sglang_shapes import encode_kv_metrics
from tests.actors.test_metrics_pipe import BASE, _until
from tests.integration.helpers import HealthServer


def _probe(settings: Settings) -> HealthProbe:
    return HealthProbe("w", settings, httpx.AsyncClient(), lambda: None, models=["m"], discover=False)


def test_a_healthy_worker_whose_frames_keep_arriving_is_probed_only_at_the_slow_interval():
    s = Settings(health_interval_s=1.0, health_busy_interval_s=5.0)
    p = _probe(s)
    p.healthy, p.probed_at = True, 100.0
    assert p.due(heard_at=103.9) == 104.9  # the frames stop at 103.9: probed one interval later
    assert p.due(heard_at=104.5) == 105.0  # frames keep coming: the slow probe, 5 s after the last
    assert p.due(heard_at=None) == 101.0  # never published: probed every interval
    assert p.due(heard_at=99.0) == 101.0  # silent since before the last probe: every interval


def test_an_unhealthy_or_timing_out_worker_is_probed_every_interval_whatever_its_frames_say():
    s = Settings(health_interval_s=1.0, health_busy_interval_s=5.0)
    p = _probe(s)
    p.probed_at = 100.0
    p.healthy = False
    assert p.due(heard_at=100.9) == 101.0
    p.healthy, p._timeouts = True, 1
    assert p.due(heard_at=100.9) == 101.0
    p._timeouts = 0
    p2 = HealthProbe("w", s, httpx.AsyncClient(), lambda: None, models=[], discover=True)
    p2.healthy, p2.probed_at = True, 100.0
    assert p2.due(heard_at=100.9) == 101.0  # its model list is still to be discovered


def test_attach_discovery_asks_for_the_model_list_before_the_worker_is_reported_healthy():
    """Never a healthy worker with no model in between (it would take every model's requests)."""
    seen: list[bool] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            seen.append(probe.healthy)
            return httpx.Response(200, json={"object": "list", "data": [{"id": "model-B", "object": "model"}]})
        return httpx.Response(200)

    async def go(p: HealthProbe) -> None:
        await p.probe("http://w:1")

    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(handler)), lambda: None,
                        models=[], discover=True)
    asyncio.run(go(probe))
    assert seen == [False] and probe.healthy and probe.models == ["model-B"]
    # a worker whose /v1/models gives no list still becomes healthy, declaring no model (documented)
    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(404 if r.url.path == "/v1/models" else 200))), lambda: None, models=[], discover=True)
    asyncio.run(go(probe))
    assert probe.healthy and probe.models == []


def test_a_probe_on_a_connection_the_worker_just_closed_is_asked_again_before_it_counts():
    """A pooled connection closed by the worker as it is reused ("Server disconnected") must not mark a
    serving worker down; a dead worker (refused twice) is down at once; the client never reuses a
    connection near uvicorn's 5 s keep-alive."""
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200)

    async def go(p: HealthProbe) -> None:
        await p.probe("http://w:1")

    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(flaky)), lambda: None,
                        models=["m"], discover=False)
    asyncio.run(go(probe))
    # (then its /v1/models: the LoRA adapters, asked at every probe that finds it healthy)
    assert probe.healthy and calls == ["/health", "/health", "/v1/models"]

    def refused(request: httpx.Request) -> httpx.Response:
        calls.append("refused")
        raise httpx.ConnectError("connection refused", request=request)

    calls.clear()
    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(refused)), lambda: None,
                        models=["m"], discover=False)
    probe.healthy = True
    asyncio.run(go(probe))
    assert not probe.healthy and "unreachable" in probe.detail and calls == ["refused", "refused"]
    from actors.health import probe_client
    client = probe_client(Settings())
    assert client._transport._pool._keepalive_expiry < 5.0  # type: ignore[attr-defined]
    asyncio.run(client.aclose())


class InProcessHost:
    """`NodeHosting` feeding a registry in-process, as the aggregator hosts its own node's workers."""

    def __init__(self, settings: Settings) -> None:
        self.registry = FleetRegistry(settings)
        self.frames = 0
        self.ctx = zmq.asyncio.Context()

        def apply(host, incarnation, workers, reports):
            self.frames += 1
            self.registry.host_frame(host, incarnation, workers, reports)

        async def deregister(name):
            return self.registry.remove(name)

        self.hosting = NodeHosting("agg", "node-1", settings, self.ctx, LocalLink(apply), deregister=deregister,
                                   remember=lambda specs: None)

    def state(self, name: str) -> str | None:
        w = next((w for w in self.registry.snapshot().workers if w.name == name), None)
        return None if w is None else w.state


async def test_the_aggregator_side_host_applies_frames_to_the_registry_without_a_socket_hop(tmp_path):
    s = Settings(health_interval_s=0.2)
    server = HealthServer()
    rig = InProcessHost(s)
    spec = WorkerSpec(name="w0", url=server.url, metrics_endpoint=f"ipc://{tmp_path}/w0.metrics",
                      served_model_names=["m"])
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        assert rig.hosting.add(spec) and not rig.hosting.add(spec)  # idempotent for the same spec
        rig.hosting.start()
        await _until(lambda: rig.state("w0") == "idle", 5)
        push.connect(spec.metrics_endpoint)
        push.send(encode_kv_metrics("0.5.23", **{**BASE, "num_requests_waiting": 7}))

        def live():
            w = next(w for w in rig.registry.snapshot().workers if w.name == "w0")
            return w.state == "live" and w.ranks[0].num_requests_waiting == 7

        await _until(live, 5)
        push.send(b"\x80\x04not a pickle at all")  # a hostile frame is refused before the registry
        await _until(lambda: rig.hosting.worker_stats("w0").frames_refused == 1, 5)
        w = next(w for w in rig.registry.snapshot().workers if w.name == "w0")
        assert w.ranks[0].num_requests_waiting == 7
        assert await rig.hosting.remove("w0", deregister=True)
        assert rig.state("w0") is None
    finally:
        push.close(linger=0)
        await rig.hosting.stop()
        rig.ctx.term()
        server.close()


async def test_passive_liveness_probes_a_publishing_worker_rarely_and_a_dead_one_within_an_interval(tmp_path):
    s = Settings(health_interval_s=0.3, health_busy_interval_s=5.0)
    server = HealthServer()
    rig = InProcessHost(s)
    spec = WorkerSpec(name="w1", url=server.url, metrics_endpoint=f"ipc://{tmp_path}/w1.metrics",
                      served_model_names=["m"])
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    publishing = True

    async def scheduler():  # SGLang's cadence under load: tens of frames a second
        i = 0
        while publishing:
            i += 1
            push.send(encode_kv_metrics("0.5.23", **{**BASE, "request_active_slots": i % 8}))
            await asyncio.sleep(0.03)

    task = None
    try:
        rig.hosting.add(spec)
        rig.hosting.start()
        await _until(lambda: rig.state("w1") == "idle", 5)
        push.connect(spec.metrics_endpoint)
        task = asyncio.get_running_loop().create_task(scheduler())
        await _until(lambda: rig.state("w1") == "live", 5)
        before = server.probes
        await asyncio.sleep(2.0)  # ~7 intervals: actively it would be probed ~7 times
        assert server.probes - before <= 1
        # the worker dies: its scheduler stops publishing and its HTTP server is gone
        publishing = False
        await task
        server.close()
        died = time.monotonic()
        await _until(lambda: rig.state("w1") == "down", 5)
        # probed once silent for an interval, refused at once (+ one frame window)
        assert time.monotonic() - died <= s.health_interval_s + 0.3
    finally:
        publishing = False
        push.close(linger=0)
        await rig.hosting.stop()
        rig.ctx.term()
        server.close()
