"""Ray Serve LLM integration, the parts that need no Ray: replica ↔ worker names, request bodies
from handle arguments, Serve's ranks from a decision, the exported metric names and the Grafana
dashboard, and the SGLang source the metrics-ipc fix relies on."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve_app.policies.base import RouteRequest
from serve_app.ray_llm.names import replica_worker_name, worker_name
from serve_app.ray_llm.ranking import reason_label, request_body, split_ranks
from serve_app.ray_llm.ray_metrics import METRICS, prometheus_names

ROOT = Path(__file__).resolve().parents[2]


def _rid(app: str, dep: str, uid: str) -> SimpleNamespace:
    return SimpleNamespace(deployment_id=SimpleNamespace(app_name=app, name=dep), unique_id=uid)


def test_server_and_router_name_a_replica_the_same_way():
    assert replica_worker_name(_rid("llm", "SGLangServer:m", "ab12")) == worker_name("llm", "SGLangServer:m", "ab12")


def test_worker_names_of_two_deployments_never_clash():
    assert replica_worker_name(_rid("a", "d1", "x")) != replica_worker_name(_rid("a", "d2", "x"))
    assert replica_worker_name(_rid("a1", "d", "x")) != replica_worker_name(_rid("a2", "d", "x"))


class _Msg:
    def __init__(self, role: str, content: str) -> None:
        self.role, self.content = role, content

    def model_dump(self, exclude_none: bool = False) -> dict:
        return {"role": self.role, "content": self.content}


def test_request_body_reads_a_chat_request_model_with_its_token_limit():
    req = SimpleNamespace(messages=[_Msg("system", "be brief"), _Msg("user", "hi")], max_tokens=7)
    body = request_body([req, None])
    assert body == {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    "max_tokens": 7}


def test_request_body_reads_a_completion_model_and_a_plain_dict():
    assert request_body([SimpleNamespace(prompt="abc", max_tokens=None)]) == {"prompt": "abc"}
    assert request_body([{"text": "x", "sampling_params": {}}]) == {"text": "x", "sampling_params": {}}


def test_request_body_is_none_without_a_prompt():
    assert request_body([]) is None
    assert request_body(None) is None
    assert request_body([{"model": "m"}, SimpleNamespace(model="m")]) is None


def test_ranks_put_the_pick_first_with_unregistered_replicas_and_the_rest_after():
    by_name = {"a": "A", "b": "B", "new": "NEW", "c": "C"}
    assert split_ranks(by_name, "b", {"a", "b", "c"}) == [["B", "NEW"], ["A", "C"]]
    assert split_ranks({"a": "A"}, "a", {"a"}) == [["A"]]


def test_reason_label_says_prefix_only_when_the_pick_holds_part_of_the_prompt():
    req = RouteRequest(prompt="p", prompt_tokens=64).with_overlap({"w1": 2})
    assert reason_label(req, "w1") == "prefix"
    assert reason_label(req, "w2") == "load"


def test_prometheus_names_follow_ray_conventions():
    names = prometheus_names()
    assert "ray_kvroute_router_decisions_total" in names
    assert {"ray_kvroute_router_decision_seconds_bucket", "ray_kvroute_router_decision_seconds_count"} <= names
    assert "ray_kvroute_worker_kv_usage_ratio" in names
    assert all(n.startswith("ray_kvroute_") for n in names)


DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute-ray.json"
_METRIC_RE = re.compile(r"\b(ray_kvroute_[a-z_]+|kvroute_[a-z_]+)\b")


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_grafana_dashboard_is_json_and_every_expression_names_an_exported_metric():
    dash = json.loads(DASHBOARD.read_text())
    exported = prometheus_names()
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    for expr in exprs:
        found = _METRIC_RE.findall(expr)
        assert found, f"expression names no kvroute metric: {expr}"
        unknown = [m for m in found if m not in exported]
        assert not unknown, f"{expr}: not exported by kvroute through Ray: {unknown}"


def test_grafana_dashboard_covers_what_the_issue_asks_for():
    dash = json.loads(DASHBOARD.read_text())
    text = " ".join(t["expr"] for p in _panels(dash) for t in p.get("targets", []))
    for metric in ("kvroute_worker_state", "kvroute_worker_kv_usage_ratio", "kvroute_router_decisions",
                   "kvroute_replica_ttft_seconds", "kvroute_replica_frames", "kvroute_worker_in_flight_requests",
                   "kvroute_snapshot_age_seconds"):
        assert metric in text, f"no panel shows {metric}"
    assert all(name in METRICS for name in ("kvroute_worker_state", "kvroute_replica_frames"))


# --- the SGLang source the server_cls's metrics-ipc fix relies on, read without importing torch ---

def _sglang_roots() -> list[Path]:
    roots = []
    for base in (Path.home() / ".cache" / "kvroute" / "venv-sglang", ROOT / ".venv-sglang"):
        roots += sorted(base.glob("*/lib/python3*/site-packages/sglang"))
    return roots


def _newest_with_ray_engine() -> Path:
    roots = [r for r in _sglang_roots() if (r / "srt" / "ray" / "engine.py").exists()]
    if not roots:
        pytest.skip("no installed SGLang with sglang.srt.ray (build one: scripts/sglang_env.sh 0.5.23)")
    return roots[-1]


def test_sglang_engine_takes_the_metrics_address_from_port_args_init_new_in_its_own_process():
    """What `patch_port_args` relies on: the in-process Engine (and RayEngine, which Ray Serve LLM's
    SGLangServer runs) allocates PortArgs with `PortArgs.init_new(server_args)` in the calling
    process, PortArgs carries `metrics_ipc_name`, and the scheduler CONNECTS a PUSH to it."""
    root = _newest_with_ray_engine()
    server_args = (root / "srt" / "server_args.py").read_text()
    cls = server_args[server_args.index("class PortArgs"):]
    assert re.search(r"^\s+metrics_ipc_name: str", cls, re.M)
    assert re.search(r"@staticmethod\s+def init_new\(\s*server_args", cls)
    engine = (root / "srt" / "entrypoints" / "engine.py").read_text()
    assert re.search(r"if port_args is None:\s+port_args = PortArgs\.init_new\(server_args\)", engine)
    ray_engine = (root / "srt" / "ray" / "engine.py").read_text()
    assert "class RayEngine(Engine)" in ray_engine
    assert "def _launch_subprocesses" not in ray_engine  # it inherits the allocation above
    assert "port_args=port_args" in ray_engine  # and hands those PortArgs to its scheduler actors
    pushes = [p for p in (root / "srt" / "managers").rglob("*.py") if re.search(
        r"zmq\.PUSH,\s*port_args\.metrics_ipc_name,\s*False", p.read_text(errors="ignore"))]
    assert pushes, "no scheduler code connects a PUSH to port_args.metrics_ipc_name"


def test_sglang_server_init_is_what_kvroute_server_cls_runs_before():
    """`KvrouteSGLangServer._start_engine` patches PortArgs, then runs `SGLangServer.__init__`, which
    builds the engine from `engine_kwargs` (so `enable_metrics` / `kv_events_config` reach it)."""
    import ray

    src = Path(ray.__file__).parent / "llm" / "_internal" / "serve" / "engines" / "sglang" / "sglang_engine.py"
    text = src.read_text()
    assert "self.engine = Engine(**self.engine_kwargs)" in text
    assert "self.engine_kwargs = llm_config.engine_kwargs" in text
    assert "from sglang.srt.ray.engine import RayEngine as Engine" in text


async def test_sim_engine_answers_like_sglang_engine_and_pushes_kv_metrics(tmp_path):
    """The sim-backed engine behind SimSGLangServer: `async_generate` in SGLang's shapes (a dict;
    a stream of dicts with cumulative text), KvMetrics frames on its metrics address."""
    import asyncio

    import zmq
    import zmq.asyncio

    from actors.wire import decode_kv_metrics
    from serve_app.ray_llm.sim_engine import SimSGLangEngine

    endpoint = f"ipc://{tmp_path}/m.metrics"
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    engine = SimSGLangEngine(metrics_ipc_name=endpoint, page_size=16, rid_prefix="w1|")
    try:
        out = await engine.async_generate(prompt="user: hello\nassistant:", sampling_params={"max_new_tokens": 5})
        assert out["meta_info"]["completion_tokens"] == 5
        assert out["meta_info"]["id"].startswith("w1|")
        assert out["meta_info"]["finish_reason"] == {"type": "length"}
        chunks = [c async for c in await engine.async_generate(prompt="user: hi", sampling_params={"max_new_tokens": 3},
                                                               stream=True)]
        assert len(chunks) == 3 and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
        assert chunks[-1]["text"].startswith(chunks[0]["text"])
        m = decode_kv_metrics(await asyncio.wait_for(pull.recv(), 5))
        assert m.request_total_slots > 0 and m.kv_total_blocks > 0
        assert engine.alive
    finally:
        engine.shutdown()
        pull.close(linger=0)
        ctx.term()
