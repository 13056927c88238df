"""Model names as SGLang takes them and LoRA adapters end to end (issue 33, items 1 and 2): name
resolution, adapter-only candidates, prefix affinity per adapter (approximate and exact), /v1/models,
and the router in front of simulated SGLang 0.5.23 workers with adapters loaded and unloaded."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn

from actors.wire.kv_events import BlockStored
from actors.protocol import Adapter
from serve_app.breaker import Breakers
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.forward import Forwarder
from serve_app.http import HttpError
from serve_app.metrics import RouterMetrics
from serve_app.prefix_index import KvEventIndex, hash_token_blocks, namespace_salt
from serve_app.proxy import UpstreamClient
from serve_app.router import RouterCore, UnknownModel
from sim.config import SimConfig
from sim.server import SimServer
from tests.serve_app.support import Clock
from tests.serve_app.support import unused_aggregator as _unused

SYSTEM = "You are the support assistant of a large retailer. Answer briefly and politely. " * 8


def put(core: RouterCore, clock: Clock, name: str, models: list[str], adapters: list[str] = (),
        url: str | None = None) -> None:
    m = dict(request_active_slots=0, request_total_slots=64, kv_active_blocks=0, kv_total_blocks=4096,
             num_requests_waiting=0, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0)
    core.follower.workers[name] = WorkerRecord(
        name=name, url=url or f"http://{name}", page_size=16, state="live", healthy=True, metrics=m,
        metrics_at=clock.t, heartbeat_at=clock.t, models=list(models),
        adapters=[Adapter(a, f"/adapters/{a}") for a in adapters])
    core.on_fleet_update([name])


def make_core(fleet: dict[str, tuple[list[str], list[str]]], **router: Any) -> tuple[RouterCore, Clock]:
    clock = Clock()
    core = RouterCore(RouterConfig(**router), FleetFollower(_unused), "r0", clock=clock)
    for name, (models, adapters) in fleet.items():
        put(core, clock, name, models, adapters)
    return core, clock


def chat(model: str | None = None, user: str = "hi", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                            "max_tokens": 2, **extra}
    if model is not None:
        body["model"] = model
    return body


# --- model names ------------------------------------------------------------------------------


def test_a_single_model_fleet_answers_any_model_and_none_as_sglang_does():
    core, _ = make_core({"w0": (["meta-llama/Llama-3.1-8B-Instruct"], []), "w1": (["meta-llama/Llama-3.1-8B-Instruct"], [])})
    for name in ("default", "gpt-4o", None, "meta-llama/Llama-3.1-8B-Instruct"):
        assert core.resolve(name) == ("meta-llama/Llama-3.1-8B-Instruct", None)


def test_strict_models_keeps_openais_404_on_a_single_model_fleet():
    core, _ = make_core({"w0": (["M"], [])}, strict_models=True)
    with pytest.raises(UnknownModel):
        core.resolve("default")
    assert core.resolve(None) == ("M", None)


def test_a_multi_model_fleet_answers_404_for_a_name_nobody_serves():
    core, _ = make_core({"a": (["A"], []), "b": (["B"], [])})
    with pytest.raises(UnknownModel):
        core.resolve("default")
    with pytest.raises(UnknownModel):
        core.resolve("C:adapter")  # (an unknown base cannot be guessed either)
    assert core.resolve("B") == ("B", None)


def test_base_colon_adapter_parses_like_sglangs_parse_model_parameter():
    core, _ = make_core({"w0": (["org/m:v1"], ["x"]), "w1": (["org/m:v1"], [])})
    assert core.resolve("org/m:v1") == ("org/m:v1", None)  # a declared name, colons and all
    assert core.resolve("org/m:v1:x") == ("org/m:v1", "x")  # the served name cut off whole
    assert core.resolve("anything:x") == ("org/m:v1", "x")  # single-model: SGLang never checks the base
    assert core.resolve("org/m:v1:", {"lora_path": "x"}) == ("org/m:v1", "x")
    assert core.resolve("org/m:v1:y", {"lora_path": "x"}) == ("org/m:v1", "y")  # the model's adapter wins
    assert core.resolve(None, {"lora_path": ["x", None]}) == ("org/m:v1", "x")


def test_a_bare_adapter_name_is_served_by_its_base_model_as_sglang_does():
    """SGLang reads an adapter only from `base:adapter` or `lora_path`; `model: "<adapter>"` is served
    by the base model — so on a multi-model fleet it goes to its parent model's workers, as a base request."""
    core, _ = make_core({"a": (["A"], ["sql"]), "b": (["B"], [])})
    assert core.resolve("sql") == ("A", None)


# --- routing ----------------------------------------------------------------------------------


def test_an_adapter_request_goes_only_to_workers_with_it_loaded_for_every_policy():
    for policy in ("kv_aware", "round_robin", "random", "least_loaded", "power_of_two"):
        core, _ = make_core({"w0": (["M"], ["a"]), "w1": (["M"], ["b"]), "w2": (["M"], ["a", "b"]),
                             "w3": (["M"], [])}, policy=policy, seed=1)
        for i in range(12):
            d, _ = core.decide(core.facts(chat("M:a", f"q{i}")), model="M", adapter="a")
            assert d.worker in {"w0", "w2"}
            d, _ = core.decide(core.facts(chat("M:b", f"q{i}")), model="M", adapter="b")
            assert d.worker in {"w1", "w2"}


def test_an_adapter_unloaded_everywhere_goes_where_it_was_loaded_then_to_the_models_workers():
    core, clock = make_core({"w0": (["M"], ["a"]), "w1": (["M"], [])}, policy="round_robin")
    put(core, clock, "w0", ["M"], [])  # unloaded: SGLang loads it again when a request names it
    assert {core.decide(core.facts(chat(user=f"q{i}")), model="M", adapter="a")[0].worker for i in range(6)} == {"w0"}
    # never loaded anywhere: any worker of the model, whose engine gives SGLang's own 400
    workers = {core.decide(core.facts(chat(user=f"q{i}")), model="M", adapter="zz")[0].worker for i in range(6)}
    assert workers == {"w0", "w1"}


def test_two_adapters_sharing_a_system_prompt_are_not_a_cache_hit():
    core, _ = make_core({"w0": (["M"], ["a", "b"]), "w1": (["M"], ["a", "b"])}, policy="kv_aware")
    t = core.route(core.facts(chat(user="first")), model="M", adapter="a")
    t.finished()
    _, req = core.decide(core.facts(chat(user="second")), model="M", adapter="a")
    assert req.overlap.get(t.worker, 0) >= 10  # same adapter: its system prompt is cached there
    _, req = core.decide(core.facts(chat(user="second")), model="M", adapter="b")
    assert not any(req.overlap.get(w, 0) for w in ("w0", "w1"))  # another adapter: nothing of it
    _, req = core.decide(core.facts(chat(user="second")), model="M")
    assert not any(req.overlap.get(w, 0) for w in ("w0", "w1"))  # nor the base model


def test_the_exact_index_keys_each_adapters_blocks_in_its_own_namespace():
    idx = KvEventIndex(4)
    toks = list(range(1, 13))
    idx.apply("w0", [BlockStored((11, 12, 13), None, tuple(toks), 4, lora_name="a")])
    idx.apply("w1", [BlockStored((21, 22, 23), None, tuple(toks), 4)])
    idx.apply("w0", [BlockStored((14,), 13, tuple(range(50, 54)), 4, lora_name="a")])  # a child, same namespace
    hashes = hash_token_blocks(toks + list(range(50, 54)), 4)
    salt = namespace_salt("a")
    assert dict(idx.overlap([h ^ salt for h in hashes]).items()) == {"w0": 4}
    assert dict(idx.overlap(hashes).items()) == {"w1": 3}
    assert dict(idx.overlap([h ^ namespace_salt("b") for h in hashes]).items()) == {}
    idx.apply("w0", [])
    assert idx.blocks("w0") == 4


def test_v1_models_lists_each_adapter_with_its_parent_as_sglang_does():
    core, _ = make_core({"w0": (["M"], ["a", "b"]), "w1": (["M"], ["a"]), "w2": (["N"], [])})
    breakers = Breakers(core.config.breaker)
    fwd = Forwarder(core, upstream=None, breakers=breakers, metrics=RouterMetrics(core, breakers),  # type: ignore[arg-type]
                    config=core.config)
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    asyncio.run(fwd.models(send, core.follower.workers))
    data = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["data"]
    assert [(m["id"], m["parent"], m["root"], m["workers"]) for m in data] == [
        ("M", None, "M", 2), ("a", "M", "/adapters/a", 2), ("b", "M", "/adapters/b", 1), ("N", None, "N", 1)]
    assert {w["name"]: w["adapters"] for w in core.workers_json()["workers"]} == {"w0": ["a", "b"], "w1": ["a"],
                                                                                 "w2": []}


# --- in front of simulated SGLang workers ------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """Simulated SGLang 0.5.23 workers on loopback (uvicorn on the test's loop) behind a Forwarder."""

    def __init__(self, sims: dict[str, SimConfig], **router: Any) -> None:
        self.sims = sims
        self.core, self.clock = make_core({}, **router)
        self.servers: list[uvicorn.Server] = []
        self.urls: dict[str, str] = {}

    async def __aenter__(self) -> "Fleet":
        for name, cfg in self.sims.items():
            port = _port()
            srv = SimServer(cfg.model_copy(update={"port": port}))
            server = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=port, log_level="error",
                                                   lifespan="on"))
            asyncio.get_running_loop().create_task(server.serve())
            self.servers.append(server)
            self.urls[name] = f"http://127.0.0.1:{port}"
        for _ in range(200):
            if all(s.started for s in self.servers):
                break
            await asyncio.sleep(0.02)
        self.upstream = UpstreamClient(2.0, 10.0)
        breakers = Breakers(self.core.config.breaker)
        self.metrics = RouterMetrics(self.core, breakers)
        self.fwd = Forwarder(self.core, self.upstream, breakers, self.metrics, self.core.config)
        await self.discover()
        return self

    async def discover(self) -> None:
        """What each worker's /v1/models says, as its HealthProbe reports it."""
        import httpx

        from actors.worker.health import HealthProbe
        from actors.models import Settings
        async with httpx.AsyncClient() as http:
            for name, cfg in self.sims.items():
                probe = HealthProbe(name, Settings(), http, lambda: None, models=[], discover=True)
                await probe.probe(self.urls[name])
                assert probe.healthy
                put(self.core, self.clock, name, probe.models, [a.name for a in probe.adapters], self.urls[name])

    async def __aexit__(self, *exc: Any) -> None:
        await self.upstream.aclose()
        for s in self.servers:
            s.should_exit = True
        await asyncio.sleep(0.3)

    async def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
                   ) -> tuple[int, dict[str, str], bytes]:
        sent: list[dict] = []

        async def send(msg: dict) -> None:
            sent.append(msg)

        req = SimpleNamespace(headers=headers or {})
        try:
            await self.fwd.forward(req, send, path, json.dumps(body).encode(), body)  # type: ignore[arg-type]
        except HttpError as exc:
            return exc.status, {}, exc.body()
        head = sent[0]
        hdrs = {k.decode(): v.decode() for k, v in head.get("headers", [])}
        return head["status"], hdrs, b"".join(m.get("body", b"") for m in sent[1:])


def _sim(**kw: Any) -> SimConfig:
    return SimConfig(model_name="base", time_scale=0.02, **kw)


async def test_adapter_requests_reach_only_the_workers_that_loaded_them_and_unknown_ones_get_sglangs_400():
    async with Fleet({"w0": _sim(lora_paths=("a=/p/a",)), "w1": _sim(lora_paths=("b=/p/b",))}) as f:
        for i in range(4):
            status, hdrs, body = await f.post("/v1/chat/completions", chat("base:a", f"q{i}"))
            assert status == 200 and hdrs["x-kvroute-worker"] == "w0", body
            status, hdrs, _ = await f.post("/v1/chat/completions", chat(user=f"q{i}", lora_path="b"))
            assert status == 200 and hdrs["x-kvroute-worker"] == "w1"
        status, _, body = await f.post("/v1/chat/completions", chat("base:zz"))
        err = json.loads(body)
        assert status == 400 and err["type"] == "BadRequestError" and err["code"] == 400
        assert err["message"].startswith("Got LoRA adapter that has never been loaded: zz")
        assert (await f.post("/v1/chat/completions", chat("default")))[0] == 200  # any name: single model


async def test_an_adapter_loaded_at_run_time_is_routed_to_after_the_next_probe():
    import httpx
    async with Fleet({"w0": _sim(enable_lora=True), "w1": _sim(enable_lora=True)}) as f:
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{f.urls['w1']}/load_lora_adapter", json={"lora_name": "new", "lora_path": "/p/n"})
            assert r.json()["success"]
        await f.discover()
        assert {(await f.post("/v1/chat/completions", chat("base:new", f"q{i}")))[1]["x-kvroute-worker"]
                for i in range(4)} == {"w1"}
        async with httpx.AsyncClient() as http:
            await http.post(f"{f.urls['w1']}/unload_lora_adapter", json={"lora_name": "new"})
        await f.discover()
        assert f.core.workers_json()["workers"][1]["adapters"] == []
        # unloaded: still routed where it was, and SGLang loads it again there
        status, hdrs, _ = await f.post("/v1/chat/completions", chat("base:new"))
        assert status == 200 and hdrs["x-kvroute-worker"] == "w1"


def test_the_banner_prints_a_request_that_works_on_the_fleet_at_hand(capsys):
    from serve_app.cli import _print_banner

    _print_banner("http://r", RouterConfig(), ["meta-llama/Llama-3.1-8B-Instruct"])
    out = capsys.readouterr().out
    body = json.loads(out.split("-d '", 1)[1].split("'\n", 1)[0])
    assert body["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert "model='meta-llama/Llama-3.1-8B-Instruct'" in out
    _print_banner("http://r", RouterConfig(), [])  # names discovered at run time: none needed, or the router's
    out = capsys.readouterr().out
    assert "model" not in json.loads(out.split("-d '", 1)[1].split("'\n", 1)[0])
    assert "model=client.models.list().data[0].id" in out
    assert "default" not in out.split("curl:", 1)[1]


def test_exact_mode_overlap_is_the_engines_own_per_adapter_cache():
    """Exact mode: what a worker's KV events say it caches, in the namespace of the adapter they name."""
    from sim.tokenizer import apply_chat_template

    core, _ = make_core({"w0": (["M"], ["a", "b"]), "w1": (["M"], ["a", "b"])}, tokenizer="sim")
    core.kv_follower = SimpleNamespace(synced={"w0", "w1"}, applied_at={})  # type: ignore[assignment]
    body = chat("M:a", "q")
    ids = apply_chat_template(body["messages"])
    n = (len(ids) // 16) * 16
    core.exact.apply("w1", [BlockStored(tuple(range(1000, 1000 + n // 16)), None, tuple(ids[:n]), 16, lora_name="a")])
    _, req = core.decide(core.facts(body), model="M", adapter="a")
    assert req.overlap.get("w1", 0) == n // 16 and req.overlap.get("w0", 0) == 0
    _, req = core.decide(core.facts(chat("M:b", "q")), model="M", adapter="b")
    assert not req.overlap.get("w1", 0)  # the same tokens under another adapter: not cached
    receipt: dict = {}
    core.decide(core.facts(body), model="M", adapter="a", receipt=receipt)
    by = {c["target"]: c for c in receipt["candidates"]}
    assert by["w1"]["overlap_source"] == "kv_events" and by["w1"]["overlap_blocks"] == n // 16
    assert receipt["adapter"] == "a"
