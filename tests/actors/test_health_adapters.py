"""A worker's LoRA adapters come from its /v1/models entries with a `parent` (SGLang's form), asked at
every probe that finds it healthy, so adapters loaded or unloaded at run time are seen (issue 33)."""

from __future__ import annotations

import asyncio

import httpx

from actors.worker.health import HealthProbe
from actors.models import Settings
from actors.protocol import Adapter


def test_adapters_are_discovered_and_kept_fresh_across_probes():
    listing = {"data": [{"id": "base", "parent": None, "root": "base"},
                        {"id": "a", "parent": "base", "root": "/p/a"}]}
    changes: list[int] = []

    def serve(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=listing) if request.url.path == "/v1/models" else httpx.Response(200)

    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(serve)),
                        lambda: changes.append(1), models=[], discover=True)
    asyncio.run(probe.probe("http://w:1"))
    assert probe.models == ["base"] and probe.adapters == [Adapter("a", "/p/a")]
    n = len(changes)
    asyncio.run(probe.probe("http://w:1"))
    assert len(changes) == n  # nothing changed: no report pushed
    listing["data"] = [listing["data"][0], {"id": "b", "parent": "base", "root": "/p/b"}]  # a unloaded, b loaded
    asyncio.run(probe.probe("http://w:1"))
    assert probe.adapters == [Adapter("b", "/p/b")] and len(changes) == n + 1
    assert probe.models == ["base"]  # the model list stays as discovered


def test_a_declared_model_list_is_kept_while_adapters_are_still_discovered():
    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}, {"id": "x", "parent": "m", "root": "/x"}]})
        return httpx.Response(200)

    probe = HealthProbe("w", Settings(), httpx.AsyncClient(transport=httpx.MockTransport(serve)), lambda: None,
                        models=["alias"], discover=False)
    asyncio.run(probe.probe("http://w:1"))
    assert probe.models == ["alias"] and [a.name for a in probe.adapters] == ["x"]


def test_the_registry_publishes_a_workers_adapters_and_a_change_of_them_bumps_it():
    from actors.protocol import WorkerReport, decode_delta, encode_delta
    from actors.aggregator.registry import FleetRegistry

    reg = FleetRegistry(Settings())
    base = dict(name="w", url="http://w", page_size=16, incarnation="i", healthy=True)
    reg.report(WorkerReport(**base, adapters=[Adapter("a", "/p/a")]))
    snap = decode_delta(encode_delta(reg.snapshot()))
    assert snap.workers[0].adapters == [Adapter("a", "/p/a")]
    reg.take_delta()
    assert reg.report(WorkerReport(**base, adapters=[]))  # unloaded: a change
    delta = reg.take_delta()
    assert delta is not None and delta.workers[0].adapters == []
