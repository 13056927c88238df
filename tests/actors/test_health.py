"""actors.worker.health: passive liveness (`HealthProbe.due`), the fast liveness probe (GET /v1/models)
and SGLang's slow /health as its confirmation, against HTTP stand-ins of a worker. No Ray."""

from __future__ import annotations

import asyncio
import time

import httpx

from actors.models import Settings
from actors.worker.health import HealthProbe


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


def test_attach_discovery_asks_for_the_model_list_before_the_worker_is_reported_healthy():
    """Never a healthy worker with no model in between (it would take every model's requests)."""
    seen: list[bool] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            seen.append(probe.healthy)
            return httpx.Response(200, json={"object": "list", "data": [{"id": models[0], "object": "model"}]})
        return httpx.Response(200)

    async def go(p: HealthProbe) -> None:
        await p.probe("http://w:1")

    models = ["model-B"]
    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(handler)), lambda: None,
                        models=[], discover=True)
    asyncio.run(go(probe))
    assert seen == [False] and probe.healthy and probe.models == ["model-B"]
    models[0] = "model-C"  # every liveness probe reads the list: a change is seen at the next one
    asyncio.run(go(probe))
    assert probe.models == ["model-C"]
    # a server without /v1/models is not an SGLang worker: not healthy, and the detail says why
    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(404 if r.url.path == "/v1/models" else 200))), lambda: None, models=[], discover=True)
    asyncio.run(go(probe))
    assert not probe.healthy and "/v1/models returned 404" in probe.detail


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
    assert probe.healthy and calls == ["/v1/models", "/v1/models", "/health"]

    def refused(request: httpx.Request) -> httpx.Response:
        calls.append("refused")
        raise httpx.ConnectError("connection refused", request=request)

    calls.clear()
    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(refused)), lambda: None,
                        models=["m"], discover=False)
    probe.healthy = True
    asyncio.run(go(probe))
    assert not probe.healthy and "unreachable" in probe.detail and calls == ["refused", "refused"]
    from actors.worker.health import probe_client
    client = probe_client(Settings())
    assert client._transport._pool._keepalive_expiry < 5.0  # type: ignore[attr-defined]
    asyncio.run(client.aclose())


class _Slow:
    """An SGLang-like worker: /v1/models at once, /health after `health_s` (SGLang waits ≥ 1 s for its
    health-check generation) with `health_code`."""

    def __init__(self, health_s: float, health_code: int = 200) -> None:
        self.health_s, self.health_code = health_s, health_code
        self.paths: list[str] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == "/health":
            await asyncio.sleep(self.health_s)
            return httpx.Response(self.health_code)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})


def test_a_health_endpoint_slower_than_the_liveness_timeout_does_not_make_a_worker_flap():
    """SGLang 0.5.23's /health answers after ≥ 1 s, longer than the 1 s liveness timeout: the probe that
    decides liveness is /v1/models; /health is confirmed once before the worker is healthy, then only in
    the background every `health_check_interval_s` — never awaited by a liveness probe."""
    s = Settings(health_interval_s=0.05, health_timeout_s=0.5, health_check_interval_s=0.3, health_check_timeout_s=3.0)
    worker = _Slow(health_s=0.7)
    changes: list[bool] = []

    async def go() -> list[float]:
        p = HealthProbe("w", s, httpx.AsyncClient(transport=httpx.MockTransport(worker)),
                        lambda: changes.append(p.healthy), models=["m"], discover=False)
        await p.probe("http://w:1")  # the first: awaits its confirmation
        assert p.healthy and p.confirmed
        took = []
        for _ in range(30):  # 1.5 s of probes at the liveness pace while confirmations run behind
            t0 = time.monotonic()
            await p.probe("http://w:1")
            took.append(time.monotonic() - t0)
            assert p.healthy, p.detail
            await asyncio.sleep(0.05)
        assert p.confirmations >= 3
        p.close()
        return took

    took = asyncio.run(go())
    assert max(took) < 0.5, "a liveness probe waited for /health"
    assert changes == [False] or changes == [] or all(changes), changes  # healthy once, never down in between


def test_a_503_from_health_marks_the_worker_down_and_a_200_brings_it_back():
    s = Settings(health_interval_s=0.05, health_check_interval_s=0.1)
    worker = _Slow(health_s=0.0)

    async def go() -> None:
        p = HealthProbe("w", s, httpx.AsyncClient(transport=httpx.MockTransport(worker)), lambda: None,
                        models=["m"], discover=False)
        await p.probe("http://w:1")
        assert p.healthy
        worker.health_code = 503  # SGLang's verdict after its scheduler stopped answering
        deadline = time.monotonic() + 3
        while p.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.12)
            await p.probe("http://w:1")
        assert not p.healthy and "/health returned 503" in p.detail
        worker.health_code = 200
        await p.probe("http://w:1")  # unconfirmed: the probe awaits a confirmation
        assert p.healthy
        p.close()

    asyncio.run(go())


def test_a_server_that_is_still_starting_is_not_healthy_before_health_says_200():
    """SGLang answers /v1/models while it loads (its /health is 503 until the server is up)."""
    worker = _Slow(health_s=0.0, health_code=503)

    async def go() -> None:
        p = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(worker)), lambda: None,
                        models=["m"], discover=False)
        await p.probe("http://w:1")
        assert not p.healthy and worker.paths == ["/v1/models", "/health"]
        p.close()

    asyncio.run(go())
