"""kvroute inside Ray Serve LLM, end to end without a GPU: Ray's own `build_openai_app` /
`OpenAiIngress` → deployment handle → `KvRouteRequestRouter` → a `SimSGLangServer` replica (Ray's
`SGLangServer` code over the simulated engine), whose KvMetrics reach kvroute's aggregator.

Ray Serve LLM imports its OpenAI protocol models from SGLang (or vLLM) at import time, so these
tests run where SGLang's Python code is installed: the SGLang lane's venv (`scripts/sglang_env.sh`,
`pytest -m sglang`); elsewhere they are skipped, naming the missing import.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from tests.integration.helpers import wait_for, wait_for_chat

pytestmark = pytest.mark.sglang

try:  # Ray Serve LLM needs its protocol models (SGLang's or vLLM's) and pyarrow
    import ray.serve.llm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the venv
    pytest.skip(f"Ray Serve LLM cannot import here ({exc}); run in the SGLang lane's venv",
                allow_module_level=True)

APP = "rayllm"
MODEL = "sim-model"
REPLICAS = 3


def _replica_of(body: dict) -> str:
    """The replica that served a reply: the simulated engine prefixes request ids with its worker name."""
    return body["id"].split("|", 1)[0]


def _fleet_names(prefix: str = "serve:") -> dict[str, str]:
    import ray

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.protocol import decode_delta

    snap = decode_delta(ray.get(get_or_create_aggregator().snapshot.remote(), timeout=10))
    return {w.name: w.state for w in snap.workers if w.name.startswith(prefix)}


@pytest.fixture(scope="module")
def llm_app(ray_cluster, serve_port):
    from ray import serve

    from serve_app.ray_llm.apps import openai_app, sim_llm_config

    cfg = sim_llm_config(MODEL, num_replicas=REPLICAS, router_kwargs={"policy": "kv_aware"})
    serve.run(openai_app(cfg), name=APP, route_prefix=f"/{APP}", blocking=False)
    base = f"http://127.0.0.1:{serve_port}/{APP}"

    wait_for_chat(base, MODEL)
    wait_for(lambda: sum(s != "down" for s in _fleet_names(f"serve:{APP}/").values()) >= REPLICAS, 60,
             interval_s=0.5, what="every replica registered with kvroute's aggregator")
    yield base
    serve.delete(APP)


def _chat(base: str, content: str, max_tokens: int = 8, timeout: float = 60) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=timeout, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def test_replicas_register_under_their_serve_replica_ids(llm_app):
    import ray

    names = [n for n, s in _fleet_names(f"serve:{APP}/").items() if s != "down"]
    assert len(names) == REPLICAS
    # serve:<app>/<deployment>/<replica id>, each the id of a live Serve replica actor
    actors = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"}
    for n in names:
        _, deployment, unique_id = n.split("/")
        assert deployment == f"SimSGLangServer:{MODEL}"
        assert f"SERVE_REPLICA::{APP}#{deployment}#{unique_id}" in actors, (n, sorted(actors))


def test_requests_flow_through_openai_ingress_to_a_replica(llm_app):
    body = _chat(llm_app, "hello there", max_tokens=5)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 5
    assert _replica_of(body) in _fleet_names(f"serve:{APP}/")


def test_shared_prefix_requests_keep_to_one_replica(llm_app):
    shared = "You are a careful assistant. " + " ".join(f"rule{i} applies here" for i in range(400))
    served = [_replica_of(_chat(llm_app, f"{shared} question {i}?", max_tokens=4)) for i in range(8)]
    # Serve's power of two among 3 idle replicas would keep 8 sequential requests on one with p ≈ 0.0005
    assert len(set(served)) == 1, Counter(served)


def test_a_burst_spreads_over_the_replicas(llm_app):
    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> str:
                r = await client.post(f"{llm_app}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 64,
                    "messages": [{"role": "user", "content": f"burst {i}: " + f"distinct text {i} " * 300}]})
                assert r.status_code == 200, r.text
                return _replica_of(r.json())
            return await asyncio.gather(*(one(i) for i in range(24)))

    served = Counter(asyncio.run(burst()))
    assert len(served) == REPLICAS, served
    assert max(served.values()) <= 16, served


def test_an_aggregator_kill_changes_nothing_clients_see(llm_app):
    from actors.aggregator.actor import kill_aggregator

    shared = "Aggregator outage context. " + " ".join(f"fact{i}" for i in range(300))
    before = _replica_of(_chat(llm_app, f"{shared} q0", max_tokens=2))
    assert kill_aggregator()
    t0 = time.monotonic()
    served = []
    while time.monotonic() - t0 < 8:  # the outage and the new aggregator's first seconds
        served.append(_replica_of(_chat(llm_app, f"{shared} q{len(served) + 1}", max_tokens=2)))
    assert len(served) >= 5
    # replicas re-register with the new aggregator (a new one: created on demand by their links)
    wait_for(lambda: sum(s != "down" for s in _fleet_names(f"serve:{APP}/").values()) >= REPLICAS, 30,
             interval_s=0.5, what="replicas registered with the new aggregator")
    after = [_replica_of(_chat(llm_app, f"{shared} r{i}", max_tokens=2)) for i in range(4)]
    assert set(after) == {before}, (before, after)


def test_a_restarted_replica_is_picked_up(llm_app):
    import ray

    names = _fleet_names(f"serve:{APP}/")
    live = sorted(n for n, s in names.items() if s != "down")
    victim = live[0]
    unique_id = victim.rsplit("/", 1)[1]
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == "serve" and a["name"].endswith(f"#{unique_id}")]
    assert len(actors) == 1, actors
    ray.kill(ray.get_actor(actors[0]["name"], namespace="serve"), no_restart=True)

    # the dead replica goes down in kvroute's fleet, Serve starts a new one, which registers
    wait_for(lambda: _fleet_names(f"serve:{APP}/").get(victim) in (None, "down"), 30, interval_s=0.5,
             what="the killed replica down or gone")

    def replaced() -> bool:
        cur = _fleet_names(f"serve:{APP}/")
        return sum(s != "down" and n != victim for n, s in cur.items()) >= REPLICAS

    wait_for(replaced, 240, interval_s=1.0, what="a replacement replica registered")
    new = {n for n, s in _fleet_names(f"serve:{APP}/").items() if s != "down"} - set(live)
    assert new

    async def burst(round_: int) -> Counter:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> str:
                r = await client.post(f"{llm_app}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 64,
                    "messages": [{"role": "user", "content": f"after restart {round_}.{i}: " + f"other {i} " * 300}]})
                assert r.status_code == 200, r.text
                return _replica_of(r.json())
            return Counter(await asyncio.gather(*(one(i) for i in range(24))))

    # The replacement registers with kvroute from its constructor, before Serve's controller marks it
    # RUNNING and the ingress's replica set (a long poll) includes it: only then can it be chosen.
    # Bursts until it serves, bounded; the killed replica must never serve.
    served: Counter = Counter()
    t0 = time.monotonic()
    rounds = 0
    while not new & set(served) and time.monotonic() - t0 < 60:
        served += asyncio.run(burst(rounds))
        rounds += 1
    assert victim not in served
    assert new & set(served), (new, served, rounds)
    # a crashed replica cannot deregister itself: the request router removes it from the fleet once it
    # is down and Serve no longer lists it (its Ray gauges are then zeroed: the metrics test below)
    wait_for(lambda: victim not in _fleet_names(f"serve:{APP}/"), 30, interval_s=0.5,
             what="the crashed replica removed from kvroute's fleet")


def test_kvroute_metrics_reach_rays_prometheus_under_the_dashboards_names(llm_app):
    """Every series `deploy/grafana/kvroute-ray.json` may query is in the Ray node's own Prometheus
    export (ray.util.metrics; no new scrape target)."""
    import re

    import ray

    from serve_app.ray_llm.ray_metrics import prometheus_names

    port = ray._private.worker._global_node.metrics_export_port
    for i in range(4):  # streamed: the replicas' TTFT histogram
        with httpx.stream("POST", f"{llm_app}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"metrics {i} " * 40}]}) as r:
            assert r.status_code == 200
            r.read()
    # every series but the attention-DP ranks' (these replicas run one rank each; tests/serve_app covers them)
    want = {n for n in prometheus_names() if not n.startswith("ray_kvroute_worker_rank_")}
    seen: set[str] = set()

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        seen.update(line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("ray_kvroute_"))
        return want <= seen

    wait_for(exported, 90, interval_s=2.0, what=f"kvroute's metrics in Ray's Prometheus (missing: {want - seen})")

    # Ray keeps a gauge's last value for the router's lifetime: a replica gone from the fleet (the one
    # test_a_restarted_replica_is_picked_up killed, when run before) must be in no state there
    state_re = re.compile(r'^ray_kvroute_worker_state\{.*worker="([^"]+)".*\} 1(\.0)?$')

    def shown_workers_are_in_the_fleet() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        shown = {m.group(1) for line in text.splitlines() if (m := state_re.match(line))}
        return bool(shown) and shown <= set(_fleet_names())

    wait_for(shown_workers_are_in_the_fleet, 30, interval_s=1.0, what="no departed replica shown in a state")


def test_streamed_first_tokens_reach_the_request_router_through_the_ingress(llm_app):
    """kvroute's ingress signals each streamed reply's first token to the router in its process,
    which releases the prefill charge; its counter in Ray's Prometheus export counts them."""
    import re

    import ray

    port = ray._private.worker._global_node.metrics_export_port

    def count() -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ray_kvroute_router_first_tokens_total{")
                   and re.search(r'deployment="SimSGLangServer:' + MODEL + '"', line))

    before = count()
    for i in range(5):
        with httpx.stream("POST", f"{llm_app}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": f"first token {i} " * 30}]}) as r:
            assert r.status_code == 200
            r.read()
    wait_for(lambda: count() >= before + 5, 90, interval_s=2.0,
             what=f"5 first-token signals counted (had {before}, now {count()})")



# --- adoption: the README's two lines on Ray's own example, and kvroute's examples (no cluster needed) ---

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
README_LINES = {  # README.md "Inside Ray Serve LLM"
    "server_cls": "serve_app.ray_llm.server:KvrouteSGLangServer",
    "request_router_config": {"request_router_class": "serve_app.ray_llm.request_router:KvRouteRequestRouter"},
}


def _rays_sglang_example_kwargs() -> dict:
    """The `LLMConfig(...)` keywords of Ray's own `ray/llm/examples/sglang/serve_sglang_example.py`, read
    from its source (importing it would start Serve)."""
    import ast
    import pathlib

    import ray

    path = pathlib.Path(ray.__file__).parent / "llm" / "examples" / "sglang" / "serve_sglang_example.py"
    if not path.exists():
        pytest.skip(f"Ray's SGLang example is not installed ({path})")
    call = next(n for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "LLMConfig")
    kwargs = {k.arg: k.value for k in call.keywords}
    assert isinstance(kwargs.pop("server_cls"), ast.Name)  # SGLangServer, the line kvroute replaces
    return {k: ast.literal_eval(v) for k, v in kwargs.items()}


def test_the_readmes_two_lines_turn_rays_own_sglang_example_into_a_kvroute_deployment():
    from ray.serve.llm import LLMConfig, build_openai_app

    from serve_app.ray_llm.request_router import KvRouteRequestRouter
    from serve_app.ray_llm.server import KvrouteSGLangServer

    kwargs = _rays_sglang_example_kwargs()
    kwargs["server_cls"] = README_LINES["server_cls"]                                          # line 1
    kwargs["deployment_config"]["request_router_config"] = README_LINES["request_router_config"]  # line 2
    cfg = LLMConfig(**kwargs)
    assert cfg.server_cls is KvrouteSGLangServer
    build_openai_app({"llm_configs": [cfg]})  # Ray validates and builds it as it would for serve run
    from ray.serve.config import RequestRouterConfig

    rrc = RequestRouterConfig(**cfg.deployment_config["request_router_config"])
    assert rrc.get_request_router_class() is KvRouteRequestRouter


def test_the_python_example_builds_with_the_real_and_the_simulated_server(monkeypatch):
    import importlib.util

    from serve_app.ray_llm.server import KvrouteSGLangServer, SimSGLangServer

    for sim, cls in (("0", KvrouteSGLangServer), ("1", SimSGLangServer)):
        monkeypatch.setenv("SIM", sim)
        spec = importlib.util.spec_from_file_location(f"kvroute_example_{sim}",
                                                      ROOT / "examples" / "ray_llm" / "serve_sglang_kvroute.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # builds the app (build_openai_app), starts nothing
        assert mod.llm_config.server_cls is cls
        rrc = mod.llm_config.deployment_config["request_router_config"]
        assert rrc["request_router_class"] == README_LINES["request_router_config"]["request_router_class"]


def test_the_serve_deploy_example_validates_and_builds():
    import yaml
    from ray.serve.llm import build_openai_app
    from ray.serve.schema import ServeDeploySchema

    from serve_app.ray_llm.server import KvrouteSGLangServer

    raw = yaml.safe_load((ROOT / "examples" / "ray_llm" / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    (app,) = raw["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    (llm,) = app["args"]["llm_configs"]
    assert llm["server_cls"] == README_LINES["server_cls"]
    assert llm["deployment_config"]["request_router_config"] == README_LINES["request_router_config"]
    built = build_openai_app(app["args"])
    assert built is not None
    from ray.serve.llm import LLMConfig

    assert LLMConfig(**llm).server_cls is KvrouteSGLangServer


def test_a_graceful_stop_deregisters_every_replica_at_once(llm_app):
    """Serve's graceful stop calls the server's `__del__`: each replica leaves kvroute's fleet there and
    then, never passing through `down` (which only a replica whose heartbeats stopped — a crash — shows
    for `down_after_s` before its removal). Runs last: it deletes the module's app."""
    from ray import serve

    running = {n for n, s in _fleet_names(f"serve:{APP}/").items() if s != "down"}
    assert len(running) >= REPLICAS
    serve.delete(APP, _blocking=False)
    seen: dict[str, set[str]] = {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 90:
        cur = {n: s for n, s in _fleet_names(f"serve:{APP}/").items() if n in running}
        for name, state in cur.items():
            seen.setdefault(name, set()).add(state)
        if not cur:
            break
        time.sleep(0.1)
    left = running & set(_fleet_names(f"serve:{APP}/"))
    assert not left, f"replicas still in the fleet 90 s after the app's deletion: {left}"
    assert all("down" not in seen.get(n, set()) for n in running), seen
