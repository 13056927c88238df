"""Exact prefix mode in kvroute's Serve request router, without a Ray cluster: the sim-backed engine
publishes KV events, the KV subscriber (what a replica's KV-log actor runs) logs them, the router's
`KvFollower` follows that log (through a stand-in for the actor handle) and the router's choice and
exact index come from what the engine reports caching. Also the `kv_events_config` the server_cls
gives the engine, checked against the real SGLang 0.5.23 parser (read from its source, no torch)."""

from __future__ import annotations

import ast
import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq.asyncio

from actors.worker.kv_subscriber import KvSubscriber
from actors.models import Settings
from actors.protocol import RankMetrics, WorkerReport
from actors.aggregator.registry import FleetRegistry
from serve_app.prompt_tokens import SimTokenizer
from serve_app.ray_llm.chat_render import SimChatTokenizer, rendered_chat_ids, serve_tokenizer
from serve_app.ray_llm.engine_config import KvrouteServerOptions, sglang_metrics_kwargs
from serve_app.ray_llm.kv_log_actor import kv_log_actor_name
from serve_app.ray_llm.names import replica_worker_name
from serve_app.ray_llm.sim_engine import SimSGLangEngine
from sim import tokenizer

APP, DEP = "llm", "SimSGLangServer:m"
MESSAGES = [{"role": "system", "content": "You are terse. " + " ".join(f"rule{i} holds" for i in range(120))},
            {"role": "user", "content": [{"type": "text", "text": "which rule matters most?"}]}]


def test_the_router_computes_the_ids_ray_serve_llm_makes_the_sim_engine_see():
    """SGLangServer renders the template to text, SGLang tokenizes that text with special tokens (a
    BOS in front of the template's own, as a Llama-3 HF tokenizer does): the router does the same."""
    tok = SimChatTokenizer()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.startswith("<|begin_of_text|><|start_header_id|>system")
    engine_ids = tok.encode(text)  # what SimSGLangEngine submits for that prompt
    assert engine_ids == [tokenizer.BOS] + tokenizer.apply_chat_template(MESSAGES)
    assert rendered_chat_ids(serve_tokenizer("sim"), {"messages": MESSAGES}) == engine_ids
    # SGLang's own HTTP server applies the template directly: kvroute's usual path (render_chat false)
    assert SimTokenizer().chat(MESSAGES) == tokenizer.apply_chat_template(MESSAGES)
    assert tok.encode("plain completion prompt") == SimTokenizer().text("plain completion prompt")
    assert rendered_chat_ids(tok, {"prompt": "x"}) is None


def test_exact_mode_engine_kwargs_point_sglang_at_the_kv_log_and_refuse_a_second_config():
    cfg = {"publisher": "zmq", "topic": "kv-events", "endpoint": "tcp://127.0.0.1:40001",
           "replay_endpoint": "tcp://127.0.0.1:40002"}
    out = sglang_metrics_kwargs({"page_size": 16}, cfg)
    assert out["enable_metrics"] is True and json.loads(out["kv_events_config"]) == cfg
    with pytest.raises(ValueError, match="kv_events_config is set"):
        sglang_metrics_kwargs({"kv_events_config": "{}"}, cfg)
    assert KvrouteServerOptions.model_validate({"kv_events": True}).kv_events
    with pytest.raises(ValueError):
        KvrouteServerOptions.model_validate({"kv_event": True})


# --- the real SGLang 0.5.23: the field exists and its own parser accepts kvroute's JSON --------------

def _sglang_0523() -> Path:
    for base in (Path.home() / ".cache" / "kvroute" / "venv-sglang", Path(__file__).resolve().parents[2] / ".venv-sglang"):
        roots = sorted(base.glob("0.5.23/lib/python3*/site-packages/sglang"))
        if roots:
            return roots[0]
    pytest.skip("SGLang 0.5.23 is not installed (scripts/sglang_env.sh 0.5.23)")


def _class_source(path: Path, name: str) -> str:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(path.read_text(), node)


def test_kv_events_config_the_server_cls_passes_is_accepted_by_sglang_0_5_23():
    """ServerArgs has `kv_events_config` (a JSON string) and `enable_metrics`; SGLang parses the JSON
    with `KVEventsConfig.from_cli` — that class's own source is executed here (pydantic only, no
    torch) and must keep every key kvroute sets, as kvroute set it."""
    root = _sglang_0523()
    obs = root / "srt" / "arg_groups" / "fields" / "observability.py"
    fields = {n.target.id: ast.unparse(n.annotation) for n in ast.walk(ast.parse(obs.read_text()))
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert fields["kv_events_config"].startswith("A[Optional[str]"), fields["kv_events_config"]
    assert fields["enable_metrics"].startswith("A[bool"), fields["enable_metrics"]
    order = (root / "srt" / "arg_groups" / "field_order.py").read_text()
    assert '"kv_events_config"' in order and '"enable_metrics"' in order  # assembled into ServerArgs

    from typing import Literal, Optional

    from pydantic import BaseModel

    ns: dict[str, Any] = {"BaseModel": BaseModel, "Optional": Optional, "Literal": Literal, "Any": Any}
    exec(compile(_class_source(root / "srt" / "disaggregation" / "kv_events.py", "KVEventsConfig"),  # noqa: S102
                 "sglang/srt/disaggregation/kv_events.py", "exec"), ns)
    parser = ns["KVEventsConfig"]
    parser.model_rebuild(_types_namespace=ns)  # its module's names (the file's own imports)
    ours = {"publisher": "zmq", "topic": "kv-events", "endpoint": "tcp://127.0.0.1:40001",
            "replay_endpoint": "tcp://127.0.0.1:40002"}
    parsed = parser.from_cli(sglang_metrics_kwargs({}, ours)["kv_events_config"])
    assert {k: getattr(parsed, k) for k in ours} == ours
    assert parsed.bind is None  # a concrete address and no "bind": SGLang CONNECTS its PUB (kv_handshake)
    from actors.wire.kv_handshake import publisher_binds

    assert not publisher_binds(ours["endpoint"], parsed.bind, "0.5.23")


# --- engine → KV subscriber → KvFollower → the router's exact index and choice -----------------------

class _ActorStandIn:
    """What `ray.get_actor(kv_log_actor_name(w))` gives the follower: `kv_since.remote(...)` awaitable."""

    def __init__(self, sub: KvSubscriber) -> None:
        # the real actor takes (and ignores) the worker a host would need
        self.kv_since = SimpleNamespace(remote=lambda epoch, seq, timeout_s=5.0, worker=None: sub.since(epoch, seq,
                                                                                                       timeout_s))


def _replica(uid: str) -> SimpleNamespace:
    from ray.serve._private.common import DeploymentID, ReplicaID

    return SimpleNamespace(replica_id=ReplicaID(unique_id=uid, deployment_id=DeploymentID(name=DEP, app_name=APP)),
                           routing_stats={})


def _ranks() -> list[RankMetrics]:
    return [RankMetrics(request_active_slots=0, request_total_slots=256, kv_active_blocks=0, kv_total_blocks=10_000,
                        num_requests_waiting=0, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0,
                        data_parallel_rank=0)]


async def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_the_router_follows_each_replicas_kv_log_and_routes_to_what_its_engine_caches(tmp_path):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from serve_app.ray_llm.request_router import KvRouteRequestRouter

    ctx = zmq.asyncio.Context()
    settings = Settings(kv_events_silence_s=1.0)
    reps = {u: _replica(u) for u in ("a", "b", "c")}
    names = {u: replica_worker_name(r.replica_id) for u, r in reps.items()}
    subs = {u: KvSubscriber(names[u], ctx, settings, "auto") for u in ("a", "b")}  # c: its log never answers
    engines = {u: SimSGLangEngine(metrics_ipc_name=f"ipc://{tmp_path}/{u}.metrics", page_size=16,
                                  kv_events_config=json.dumps(subs[u].config())) for u in subs}
    for s in subs.values():
        s.start()
    router = KvRouteRequestRouter(deployment_id=DeploymentID(name=DEP, app_name=APP),
                                  handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="kv_aware", tokenizer="sim", ray_metrics=False, router={"seed": 1})
    router._started = True  # the aggregator stream needs Ray: the fleet is fed below

    async def resolve(actor: str) -> Any:
        for u, s in subs.items():
            if actor == kv_log_actor_name(names[u]):
                return _ActorStandIn(s)
        raise ValueError(f"Failed to look up actor with name '{actor}'")  # what ray.get_actor raises

    kvf = router.core.kv_follower
    assert kvf is not None
    kvf._resolve = resolve
    try:
        # the engine of replica b has served the shared prompt (SGLangServer renders it with the template)
        prompt = SimChatTokenizer().apply_chat_template(MESSAGES, tokenize=False)
        out = await engines["b"].async_generate(prompt=prompt, sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["completion_tokens"] == 2
        # libzmq drops what a connecting PUB sends before the subscription reaches it: the replay fills it
        # in once the collector's heartbeat shows KV pages held (busy)
        await _until(lambda: subs["b"].watch(True) == "ok" and subs["b"].log.blocks() > 0, 10, "b's KV events logged")
        engine_blocks = subs["b"].log.blocks()
        assert engine_blocks >= len(tokenizer.apply_chat_template(MESSAGES)) // 16

        reg = FleetRegistry()
        for u in reps:
            reg.report(WorkerReport(name=names[u], url="", page_size=16, incarnation="i", healthy=True,
                                    ranks=_ranks(), kv_events_actor=kv_log_actor_name(names[u])))
        f = router.follower
        f.on_update(f.apply(reg.snapshot()))
        f.connected, f.last_ok_at = True, time.monotonic()

        await _until(lambda: {names["a"], names["b"]} <= kvf.synced, 10, "the router following a's and b's logs")
        assert router.core.exact.blocks(names["b"]) == engine_blocks  # the engine's blocks, in the router
        assert router.core.exact.blocks(names["a"]) == 0
        assert names["c"] not in kvf.synced  # unreachable log: not followed, still a candidate

        cands = list(reps.values())
        req = SimpleNamespace(args=[SimpleNamespace(messages=MESSAGES, prompt=None, max_tokens=4)],
                              metadata=SimpleNamespace(internal_request_id="r1"))
        ranks = await router.choose_replicas(cands, req)
        assert ranks[0][0] is reps["b"] and router.decisions == {"prefix": 1}
        # a prompt no engine holds is still routed (load terms), to a replica the router knows
        other = SimpleNamespace(args=[SimpleNamespace(messages=[{"role": "user", "content": "fresh " * 200}],
                                                      prompt=None, max_tokens=4)],
                                metadata=SimpleNamespace(internal_request_id="r2"))
        ranks = await router.choose_replicas(cands, other)
        assert ranks[0][0] in cands and router.decisions.get("load") == 1

        # the replica leaves the fleet (stopped, or down past the timeout): its log is no longer followed
        reg.take_delta()  # (what the snapshot above already held)
        reg.remove(names["b"])
        f.on_update(f.apply(reg.take_delta()))
        assert router.core.exact.blocks(names["b"]) == 0 and names["b"] not in kvf.synced
    finally:
        await kvf.stop()
        for e in engines.values():
            e.shutdown()
        for s in subs.values():
            await s.close()
        ctx.term()


def test_exact_index_counts_a_workers_blocks_over_its_ranks():
    from actors.wire.kv_events import BlockRemoved, BlockStored
    from serve_app.prefix_index import KvEventIndex

    idx = KvEventIndex(2)
    idx.apply("w", [BlockStored((11, 12), None, (1, 2, 3, 4), 2)], rank=0)
    idx.apply("w", [BlockStored((21,), None, (5, 6), 2)], rank=1)
    idx.apply("v", [BlockStored((31,), None, (7, 8), 2)])
    assert idx.blocks("w") == 3 and idx.blocks("v") == 1 and idx.blocks("x") == 0
    idx.apply("w", [BlockRemoved((12,))], rank=0)
    assert idx.blocks("w") == 2


def test_the_sim_engine_publishes_as_the_configured_release_and_refuses_other_publishers():
    import zmq

    from serve_app.ray_llm.sim_engine import kv_event_publisher

    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="only the zmq publisher"):
            kv_event_publisher('{"publisher": "null"}', "0.5.23", ctx)
        old = kv_event_publisher({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1"}, "0.5.8", ctx)
        new = kv_event_publisher({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1"}, "0.5.23", ctx)
        assert (old.encoding, new.encoding) == ("array", "map")  # tagged arrays up to 0.5.18, maps from 0.5.20
        assert not old.binds and not new.binds  # a concrete tcp address: SGLang connects
        old.close()
        new.close()
    finally:
        ctx.term()
