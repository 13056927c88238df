"""Exact prefix mode inside Ray Serve LLM, end to end without a GPU: `SimSGLangServer` replicas with
`kv_events: true` (each engine publishes its KV events to the replica's KV-log actor) behind Ray's
`OpenAiIngress`, routed by `KvRouteRequestRouter` with `tokenizer: sim` (it follows those logs).
The router's exact index is read from Ray's own Prometheus export (`kvroute_worker_exact_blocks`),
the engine's side from the KV-log actor: if KV events do not flow end to end, these tests fail.

Runs where Ray Serve LLM imports (the SGLang lane's venv, `pytest -m sglang`), like test_ray_llm_serve.
"""

from __future__ import annotations

import re
from collections import Counter

import httpx
import pytest

from tests.integration.helpers import wait_for, wait_for_chat

pytestmark = pytest.mark.sglang

try:
    import ray.serve.llm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the venv
    pytest.skip(f"Ray Serve LLM cannot import here ({exc}); run in the SGLang lane's venv",
                allow_module_level=True)

APP = "rayllmx"
MODEL = "sim-exact"
REPLICAS = 2


def _replica_of(body: dict) -> str:
    return body["id"].split("|", 1)[0]


def _fleet() -> dict:
    import ray

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.protocol import decode_delta

    snap = decode_delta(ray.get(get_or_create_aggregator().snapshot.remote(), timeout=10))
    return {w.name: w for w in snap.workers if w.name.startswith(f"serve:{APP}/")}


def _live() -> dict:
    return {n: w for n, w in _fleet().items() if w.state != "down"}


def _engine_blocks(worker: str) -> int:
    """Blocks the replica's engine reported caching (its KV-log actor's count)."""
    import ray

    from actors.models import NAMESPACE
    from serve_app.ray_llm.kv_log_actor import kv_log_actor_name

    return ray.get(ray.get_actor(kv_log_actor_name(worker), NAMESPACE).stats.remote(), timeout=10).blocks


def _router_exact_blocks() -> dict[str, float]:
    """`ray_kvroute_worker_exact_blocks` per worker, from the Ray node's Prometheus export (the
    request router runs in the ingress replica; this is how its state leaves that process)."""
    import ray

    port = ray._private.worker._global_node.metrics_export_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_kvroute_worker_exact_blocks{"):
            m = re.search(r'worker="([^"]+)"', line)
            if m and m.group(1).startswith(f"serve:{APP}/"):
                out[m.group(1)] = max(out.get(m.group(1), -1.0), float(line.rsplit(" ", 1)[1]))
    return out


@pytest.fixture(scope="module")
def exact_app(ray_cluster, serve_port):
    from ray import serve

    from serve_app.ray_llm.apps import openai_app, sim_llm_config

    cfg = sim_llm_config(MODEL, num_replicas=REPLICAS, kv_events=True,
                         router_kwargs={"policy": "kv_aware", "tokenizer": "sim"})
    serve.run(openai_app(cfg), name=APP, route_prefix=f"/{APP}", blocking=False)
    base = f"http://127.0.0.1:{serve_port}/{APP}"

    wait_for_chat(base, MODEL)
    wait_for(lambda: sum(w.kv_events_actor is not None for w in _live().values()) >= REPLICAS, 60, interval_s=0.5,
             what="every replica registered with its KV-log actor")
    yield base
    serve.delete(APP)


def _chat(base: str, system: str, question: str, max_tokens: int = 4) -> str:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return _replica_of(r.json())


def test_replicas_name_their_kv_log_actor_like_worker_actors_do(exact_app):
    from serve_app.ray_llm.kv_log_actor import kv_log_actor_name

    for name, w in _live().items():
        assert w.kv_events_actor == kv_log_actor_name(name)
        assert w.kv_events is not None


def test_shared_prefix_keeps_to_one_replica_and_the_router_holds_the_engines_blocks(exact_app):
    system = "You are a careful assistant. " + " ".join(f"clause{i} binds" for i in range(300))
    served = [_chat(exact_app, system, f"question {i}?") for i in range(8)]
    assert len(set(served)) == 1, Counter(served)
    (worker,) = set(served)
    assert _engine_blocks(worker) >= 600 // 16  # the engine cached the shared prompt (and said so)
    got: dict[str, float] = {}

    def router_holds_engine_blocks() -> bool:
        got.update(_router_exact_blocks())
        return got.get(worker, -1) == _engine_blocks(worker) > 0

    wait_for(router_holds_engine_blocks, 90, interval_s=2.0,
             what=f"the router's exact index holding {worker}'s engine blocks (router: {got})")


def test_a_restarted_replica_and_its_kv_log_are_picked_up(exact_app):
    import ray

    from actors.models import NAMESPACE
    from serve_app.ray_llm.kv_log_actor import kv_log_actor_name

    live = sorted(_live())
    victim = live[0]
    unique_id = victim.rsplit("/", 1)[1]
    (actor,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and a["name"].endswith(f"#{unique_id}")]
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)

    def log_gone() -> bool:  # owned by the replica: Ray ends it with its owner
        try:
            ray.get(ray.get_actor(kv_log_actor_name(victim), NAMESPACE).stats.remote(), timeout=5)
        except Exception:
            return True
        return False

    wait_for(log_gone, 60, interval_s=0.5, what="the killed replica's KV-log actor gone with it")
    wait_for(lambda: len(set(_live()) - {victim}) >= REPLICAS and all(
        w.kv_events_actor for n, w in _live().items() if n != victim), 240, interval_s=1.0,
        what="a replacement replica registered with its KV-log actor")
    new = set(_live()) - set(live)
    assert new
    # requests reach the new replica, and the router follows its engine's KV events
    seen: Counter = Counter()
    for i in range(12):
        system = f"restart topic {i}: " + " ".join(f"detail{i}x{j}" for j in range(200))
        seen[_chat(exact_app, system, "summarise")] += 1
    assert victim not in seen and new & set(seen), (new, seen)
    (fresh,) = sorted(new & set(seen))[:1]
    got: dict[str, float] = {}

    def followed() -> bool:
        got.update(_router_exact_blocks())
        return got.get(fresh, -1) == _engine_blocks(fresh) > 0

    wait_for(followed, 90, interval_s=2.0, what=f"the router following the new replica {fresh} (router: {got})")
