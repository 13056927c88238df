"""Multi-model fleets (issue 19, item 1): routing only among the workers of the named model, the
404 for a model nobody serves, /v1/models as the fleet's union, per-model prefix affinity."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace
from typing import Any

import pytest

from actors.fleet import FleetError, parse_fleet
from actors.models import Settings
from actors.protocol import RankMetrics, WorkerReport, decode_delta, encode_delta
from actors.aggregator.registry import FleetRegistry
from serve_app.breaker import Breakers
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.forward import Forwarder
from serve_app.http import HttpError
from serve_app.metrics import RouterMetrics
from serve_app.policies import POLICIES, NoWorkerAvailable
from serve_app.router import ModelRequired, RouterCore, UnknownModel
from tests.serve_app.support import Clock
from tests.serve_app.support import unused_aggregator as _unused


def put(core: RouterCore, clock: Clock, name: str, models: list[str], state: str = "live", running: int = 0) -> None:
    m = dict(request_active_slots=running, request_total_slots=64, kv_active_blocks=0, kv_total_blocks=4096,
             num_requests_waiting=0, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0)
    core.follower.workers[name] = WorkerRecord(name=name, url=f"http://{name}", page_size=16, state=state,
                                               healthy=state != "down", metrics=m, metrics_at=clock.t,
                                               heartbeat_at=clock.t, models=list(models))
    core.on_fleet_update([name])


def make_core(fleet: dict[str, list[str]], **router: Any) -> tuple[RouterCore, Clock]:
    clock = Clock()
    core = RouterCore(RouterConfig(**router), FleetFollower(_unused), "r0", clock=clock)
    for name, models in fleet.items():
        put(core, clock, name, models)
    return core, clock


def chat(model: str | None, system: str, question: str = "q") -> dict:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    if model is not None:
        body["model"] = model
    return body


def test_misrouting_across_models_is_impossible_over_random_fleets_and_requests():
    """Property: over random fleets (1-4 models, aliases, workers in every state, some declaring
    no model), random policies, prompts shared across models and random exclusions, a request
    naming model M only ever lands on a worker declaring M or declaring none; NoWorkerAvailable
    only when no such live/idle worker is left; a name nobody may serve is UnknownModel."""
    rng = random.Random(19)
    routed = 0
    for trial in range(150):
        n_models = rng.randint(1, 4)
        models = [f"model-{chr(65 + i)}" for i in range(n_models)]
        # (strict: an unknown name is a 404 on single-model fleets too — non-strict fleets: test_lora.py)
        core, clock = make_core({}, policy=rng.choice(sorted(POLICIES)), seed=trial, strict_models=True)
        serves: dict[str, set[str]] = {}
        states: dict[str, str] = {}
        for i in range(rng.randint(1, 8)):
            name = f"w{i}"
            own = rng.sample(models, rng.randint(1, min(2, n_models)))
            if rng.random() < 0.3:
                own.append(own[0] + "-alias")
            if rng.random() < 0.1:
                own = []  # declares nothing (attach mode, /v1/models not answered): model-agnostic
            state = rng.choice(["live", "live", "idle", "down"])
            put(core, clock, name, own, state=state, running=rng.randint(0, 8))
            serves[name], states[name] = set(own), state
        served = set().union(*serves.values())
        agnostic = {w for w, ms in serves.items() if not ms}
        prompts = ["shared system prompt " * rng.randint(20, 200) for _ in range(3)]
        for j in range(40):
            clock.t += 0.01
            if rng.random() < 0.15:  # a worker changes state or models (or leaves) between requests
                name = rng.choice(sorted(serves))
                if rng.random() < 0.2 and len(serves) > 1:
                    del core.follower.workers[name], serves[name], states[name]
                    core.on_fleet_update([name])
                else:
                    own = rng.sample(models, 1) if rng.random() < 0.5 else sorted(serves[name])
                    states[name] = rng.choice(["live", "idle", "down"])
                    put(core, clock, name, own, state=states[name], running=rng.randint(0, 8))
                    serves[name] = set(own)
                served = set().union(*serves.values())
                agnostic = {w for w, ms in serves.items() if not ms}
            model = rng.choice(sorted(served) + ["not-served"]) if served else "not-served"
            policy = rng.choice(sorted(POLICIES))
            exclude = {w for w in serves if rng.random() < 0.2}
            body = chat(model, rng.choice(prompts), f"q{j}")
            if model == "not-served" and served and not agnostic:
                with pytest.raises(UnknownModel) as err:
                    core.resolve_model(model)
                assert err.value.served == sorted(served)
                continue
            key = core.resolve_model(model)
            assert key == (model if served else None)
            candidates = {w for w, ms in serves.items()
                          if (model in ms or not ms) and w not in exclude and states[w] != "down"}
            try:
                ticket = core.route(core.facts(body), policy, exclude=exclude, model=key)
            except NoWorkerAvailable:
                assert not candidates, (trial, j, model, policy, candidates)
                continue
            assert model in serves[ticket.worker] or not serves[ticket.worker], (trial, j, model, ticket.worker)
            assert ticket.worker in candidates
            ticket.first_token()
            if rng.random() < 0.5:
                ticket.finished()
            routed += 1
    assert routed > 1000


def _put_any(core: RouterCore, clock: Clock, name: str, models: list[str], state: str, role: str, dp_size: int,
             rng: random.Random) -> None:
    """A worker of any shape: a PD role (or none) and 1-3 attention-DP ranks, each with its own load."""
    ranks = [dict(request_active_slots=rng.randint(0, 8), request_total_slots=64, kv_active_blocks=rng.randint(0, 400),
                  kv_total_blocks=4096, num_requests_waiting=rng.randint(0, 2), gpu_cache_usage_perc=0.0,
                  gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=r) for r in range(dp_size)]
    core.follower.workers[name] = WorkerRecord(
        name=name, url=f"http://{name}.local:30000", page_size=16, state=state, healthy=state != "down",
        metrics=ranks[0], ranks=ranks if dp_size > 1 else [], metrics_at=clock.t, heartbeat_at=clock.t,
        models=list(models), role=role, bootstrap_port=8998 if role == "prefill" else None, dp_size=dp_size,
        rank_at={r: clock.t for r in range(dp_size)} if dp_size > 1 else {})
    core.on_fleet_update([name])


def test_misrouting_is_impossible_over_random_fleets_with_pd_roles_and_dp_ranks():
    """Property, the same as above on fleets that also mix PD roles (a model served by prefill +
    decode workers, another by ordinary ones) and attention-DP workers: a request for model M goes
    to a pair (prefill + decode worker, both declaring M or none) exactly when some worker that
    may serve M has a PD role, else to one ordinary worker of M; every chosen rank is one of its
    worker's; no side is ever down or excluded; NoWorkerAvailable only when a side has no candidate."""
    from serve_app.pd import route_pair

    rng = random.Random(1919)
    routed = pairs = 0
    for trial in range(120):
        models = [f"model-{chr(65 + i)}" for i in range(rng.randint(1, 3))]
        pd_models = {m for m in models if rng.random() < 0.5}
        core, clock = make_core({}, policy=rng.choice(sorted(POLICIES)), seed=trial)
        serves: dict[str, set[str]] = {}
        roles: dict[str, str] = {}
        sizes: dict[str, int] = {}
        states: dict[str, str] = {}
        for i in range(rng.randint(2, 9)):
            name = f"w{i}"
            m = rng.choice(models)
            own = [m] + ([m + "-alias"] if rng.random() < 0.2 else [])
            role = rng.choice(["prefill", "decode"]) if m in pd_models else "both"
            if rng.random() < 0.05:
                own = []  # model-agnostic
            state = rng.choice(["live", "live", "idle", "down"])
            dp = rng.choice([1, 1, 2, 3])
            _put_any(core, clock, name, own, state, role, dp, rng)
            serves[name], roles[name], sizes[name], states[name] = set(own), role, dp, state
        served = set().union(*serves.values())
        prompts = ["a system prompt shared by every model " * rng.randint(10, 120) for _ in range(3)]
        for j in range(30):
            clock.t += 0.01
            model = rng.choice(sorted(served)) if served else "anything"
            policy = rng.choice(sorted(POLICIES))
            exclude = {w for w in serves if rng.random() < 0.15}
            key = core.resolve_model(model)
            may = {w for w, ms in serves.items() if not ms or model in ms}
            facts = core.facts(chat(model, rng.choice(prompts), f"q{j}"))
            ok = lambda w, role: w in may and roles[w] == role and w not in exclude and states[w] != "down"  # noqa: E731
            if core.disaggregated(key):
                assert any(roles[w] != "both" for w in may), (trial, j, model)
                try:
                    pre, dec = route_pair(core, facts, policy, key, exclude)
                except NoWorkerAvailable:
                    assert not any(ok(w, "prefill") for w in serves) or not any(ok(w, "decode") for w in serves)
                    continue
                for t, role in ((pre, "prefill"), (dec, "decode")):
                    assert ok(t.worker, role), (trial, j, model, role, t.worker)
                    assert (t.decision.rank is None) == (sizes[t.worker] == 1)
                    assert t.decision.rank is None or 0 <= t.decision.rank < sizes[t.worker]
                    t.finished()
                pairs += 1
            else:
                assert all(roles[w] == "both" for w in may), (trial, j, model)
                try:
                    t = core.route(facts, policy, exclude=exclude, model=key)
                except NoWorkerAvailable:
                    assert not any(ok(w, "both") for w in serves)
                    continue
                assert ok(t.worker, "both"), (trial, j, model, t.worker)
                assert t.decision.rank is None or 0 <= t.decision.rank < sizes[t.worker]
                t.finished()
            routed += 1
    assert routed > 1000 and pairs > 300


def test_a_prefix_cached_on_a_model_b_worker_never_attracts_a_model_a_request():
    core, _ = make_core({"a0": ["A"], "a1": ["A"], "b0": ["B"]}, policy="kv_aware")
    system = "a long shared system prompt " * 300
    for i in range(3):
        t = core.route(core.facts(chat("B", system, f"q{i}")), model="B")
        assert t.worker == "b0"
        t.finished()
    _, request = core.decide(core.facts(chat("A", system)), model="A")
    assert request.overlap.get("b0", 0) == 0  # the index is keyed by (model, block)
    assert not any(request.overlap.values())
    _, request = core.decide(core.facts(chat("B", system)), model="B")
    assert request.overlap.get("b0", 0) > 0  # while B's own affinity is there


def test_a_models_aliases_share_its_prefix_affinity_and_other_models_still_do_not():
    core, _ = make_core({"b0": ["B", "b-alias"], "b1": ["b-alias", "B"], "a0": ["A"]}, policy="kv_aware")
    system = "a long shared system prompt " * 300
    t = core.route(core.facts(chat("B", system, "q0")), model="B")
    t.finished()
    _, request = core.decide(core.facts(chat("b-alias", system)), model="b-alias")
    assert request.overlap.get(t.worker, 0) > 0  # the same model: the cache a B request filled
    _, request = core.decide(core.facts(chat("A", system)), model="A")
    assert not any(request.overlap.values())
    # a chain of aliases over several workers is one model; a single model under two names is unsalted
    from serve_app.router import _alias_roots
    assert _alias_roots([("x", "y"), ("z", "y"), ("q",)]) == {"x": "x", "y": "x", "z": "x", "q": "q"}
    solo, _ = make_core({"s0": ["S", "s-alias"]})
    assert solo._prefix_keys((1, 2), "s-alias") == (1, 2)


def test_round_robin_cycles_each_models_workers_when_the_models_requests_arrive_in_turn():
    """One cycle per model: with a cycle shared by both models, A and B requests arriving
    alternately would send every A request to the same A worker (seen as kvroute round_robin's
    tail at 2x sglang-router's per-model round robin in bench/results/two-model.md)."""
    core, _ = make_core({"a0": ["A"], "a1": ["A"], "b0": ["B"], "b1": ["B"]}, policy="round_robin")
    got: dict[str, list[str]] = {"A": [], "B": []}
    for i in range(8):
        for model in ("A", "B"):
            d, _ = core.decide(core.facts(chat(model, "s", f"q{i}")), model=model)
            got[model].append(d.worker)
    assert got["A"] == ["a0", "a1"] * 4
    assert got["B"] == ["b0", "b1"] * 4


def test_model_resolution_single_multi_unknown_and_model_agnostic_fleets():
    agnostic, _ = make_core({"w0": [], "w1": []})
    assert agnostic.resolve_model("anything") is None and agnostic.resolve_model(None) is None
    single, _ = make_core({"w0": ["A", "a"], "w1": ["A", "a"]})
    assert single.resolve_model(None) == "A"  # no `model` on a single-model fleet: routed as before
    assert single.resolve_model("a") == "a"
    assert single.resolve_model("B") == "A"  # one model served, another named: served, as SGLang does
    strict, _ = make_core({"w0": ["A", "a"], "w1": ["A", "a"]}, strict_models=True)
    with pytest.raises(UnknownModel):
        strict.resolve_model("B")  # strict_models: OpenAI's 404
    multi, clock = make_core({"w0": ["A"], "w1": ["B"]})
    with pytest.raises(ModelRequired):
        multi.resolve_model(None)
    put(multi, clock, "w1", ["A"])  # a worker's model changes: the index follows
    assert multi.served_models() == ["A"] and multi.serving("A") == {"w0", "w1"}
    del multi.follower.workers["w0"]
    multi.on_fleet_update(["w0"])
    assert multi.serving("A") == {"w1"}
    del multi.follower.workers["w1"]
    multi.on_fleet_update(["w1"])
    assert multi.served_models() == [] and multi.resolve_model("A") is None


def test_a_worker_declaring_no_model_is_a_candidate_for_any_and_the_only_one_for_undeclared_names():
    core, _ = make_core({"a0": ["A"], "b0": ["B"], "u": []})
    assert core.resolve_model("other") == "other" and core.serving("other") == {"u"}
    assert core.serving("A") == {"a0", "u"}
    for i in range(20):
        assert core.route(core.facts(chat("other", f"p{i} " * 40)), policy_name="round_robin", model="other").worker == "u"
    assert {core.route(core.facts(chat("A", f"p{i} " * 40)), policy_name="round_robin", model="A").worker
            for i in range(20)} == {"a0", "u"}
    assert core.served_models() == ["A", "B"]  # /v1/models lists what is declared


def test_every_serving_worker_excluded_is_a_clear_no_worker_error():
    core, _ = make_core({"a0": ["A"], "b0": ["B"]})
    with pytest.raises(NoWorkerAvailable, match="model 'A'"):
        core.route(core.facts(chat("A", "x " * 50)), exclude={"a0"}, model="A")


def _forwarder(core: RouterCore) -> Forwarder:
    breakers = Breakers(core.config.breaker)
    return Forwarder(core, upstream=None, breakers=breakers, metrics=RouterMetrics(core, breakers),  # type: ignore[arg-type]
                     config=core.config)


def test_an_unknown_model_is_openais_404_model_not_found_listing_the_served_ones():
    core, _ = make_core({"a0": ["A"], "b0": ["B", "b-alias"]})
    fwd = _forwarder(core)
    req = SimpleNamespace(headers={})
    with pytest.raises(HttpError) as err:
        fwd.routing_input(req, chat("C", "hello"))  # type: ignore[arg-type]
    e = err.value
    body = json.loads(e.body())
    assert e.status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] is None  # OpenAI's shape
    assert body["error"]["message"].endswith("served: A, B, b-alias") and "'C'" in body["error"]["message"]
    with pytest.raises(HttpError) as err:
        fwd.routing_input(req, chat(None, "hello"))  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.code == "model_required"
    with pytest.raises(HttpError) as err:
        fwd.routing_input(req, {**chat(None, "hello"), "model": 7})  # type: ignore[arg-type]
    assert err.value.status == 400
    _, _, model, _ = fwd.routing_input(req, chat("b-alias", "hello"))  # type: ignore[arg-type]
    assert model == "b-alias"


def test_v1_models_is_the_union_of_the_fleet_answered_without_an_upstream_call():
    core, _ = make_core({"a0": ["A"], "a1": ["A"], "b0": ["B", "b-alias"]})
    fwd = _forwarder(core)  # upstream=None: any upstream call would fail
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    asyncio.run(fwd.models(send, core.follower.workers))
    assert sent[0]["status"] == 200
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["workers"]) for m in body["data"]] == [("A", "model", 2), ("B", "model", 1),
                                                                          ("b-alias", "model", 1)]


def test_workers_json_healthz_and_prometheus_show_each_workers_models():
    core, _ = make_core({"a0": ["A"], "b0": ["B", "b"], "u": []})
    assert {w["name"]: w["models"] for w in core.workers_json()["workers"]} == {"a0": ["A"], "b0": ["B", "b"], "u": []}
    assert core.healthz()["models"] == ["A", "B", "b"]
    text = RouterMetrics(core, Breakers(core.config.breaker)).render().decode()
    lines = sorted(line for line in text.splitlines() if line.startswith("kvroute_worker_model{"))
    assert lines == ['kvroute_worker_model{model="A",worker="a0"} 1.0', 'kvroute_worker_model{model="B",worker="b0"} 1.0',
                     'kvroute_worker_model{model="b",worker="b0"} 1.0']


def test_the_request_counter_carries_the_declared_model_and_never_an_arbitrary_name():
    core, clock = make_core({"a0": ["A"], "u": []})
    put(core, clock, "a0", ["A"], state="down")
    put(core, clock, "u", [], state="down")
    fwd = _forwarder(core)
    req = SimpleNamespace(headers={})
    for name in ("A", "client-made-up-name"):  # the second only the model-agnostic worker may take
        body = chat(name, "hello")
        with pytest.raises(HttpError) as err:
            asyncio.run(fwd.forward(req, None, "/v1/chat/completions", json.dumps(body).encode(), body))  # type: ignore[arg-type]
        assert err.value.status == 503
    text = fwd.metrics.render().decode()
    lines = sorted(line for line in text.splitlines() if line.startswith("kvroute_requests_total{"))
    assert lines == ['kvroute_requests_total{model="",outcome="no_worker",policy="kv_aware",worker=""} 1.0',
                     'kvroute_requests_total{model="A",outcome="no_worker",policy="kv_aware",worker=""} 1.0']


def test_the_models_travel_from_the_report_through_the_registry_and_delta_to_the_follower():
    reg = FleetRegistry(Settings(), clock=Clock())
    rank = [RankMetrics(0, 8, 0, 100, 0, 0.0, 0.0, 0, 0.0, 1)]
    reg.report(WorkerReport(name="a", url="http://a", page_size=16, incarnation="i", healthy=True, ranks=rank,
                            models=["A", "a-alias"]))
    reg.report(WorkerReport(name="b", url="http://b", page_size=16, incarnation="i", healthy=True, ranks=rank))
    f = FleetFollower(_unused)
    f.apply(decode_delta(encode_delta(reg.snapshot())))
    assert f.workers["a"].models == ["A", "a-alias"] and f.workers["b"].models == []
    reg.take_delta()
    reg.report(WorkerReport(name="b", url="http://b", page_size=16, incarnation="i", healthy=True, ranks=rank,
                            models=["B"]))  # attach mode: /v1/models answered later
    d = reg.take_delta()
    assert d is not None and [w.name for w in d.workers] == ["b"]
    f.apply(decode_delta(encode_delta(d)))
    assert f.workers["b"].models == ["B"]


def test_fleet_entries_declare_their_models():
    fleet = parse_fleet({"workers": [
        {"name": "m", "engine": "sim", "model": "A", "replicas": 2},
        {"name": "s", "engine": "sglang", "model": "/models/llama", "engine_args": {"served_model_name": "llama"}},
        {"name": "x", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/x", "served_model_names": ["B", "b"]},
        {"name": "y", "url": "http://127.0.0.1:2", "metrics_endpoint": "ipc:///tmp/y"},
    ]})
    assert [w.declared_models for w in fleet.expanded()] == [["A"], ["A"], ["llama"], ["B", "b"], []]
    for bad in (["B", "B"], [""], [" B"]):
        with pytest.raises(FleetError, match="served_model_names"):
            parse_fleet({"workers": [{"name": "x", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/x",
                                      "served_model_names": bad}]})


def test_demo_models_splits_the_workers_between_the_models_and_status_shows_them():
    from serve_app.cli import build_parser, demo_fleet
    from serve_app.status import render

    fleet = demo_fleet(4, tmpdir="/tmp/kvroute-test", models=["A", "B"])
    assert [(w.name, w.declared_models) for w in fleet.workers] == [
        ("sim-0", ["A"]), ("sim-1", ["B"]), ("sim-2", ["A"]), ("sim-3", ["B"])]
    assert build_parser().parse_args(["demo", "--models", "A,B"]).models == "A,B"
    assert all(w.declared_models == [] for w in demo_fleet(2, tmpdir="/tmp/kvroute-test").workers)
    core, _ = make_core({"a0": ["A"], "b0": ["B", "b"]})
    table = render(core.workers_json())
    assert [c.header for c in table.columns][:2] == ["worker", "model"]
    assert list(table.columns[1].cells) == ["A", "B, b"]
    agnostic, _ = make_core({"w0": []})
    assert "model" not in [c.header for c in render(agnostic.workers_json()).columns]


def test_demo_refuses_bad_model_lists_before_starting_anything(capsys):
    from serve_app.cli import build_parser, cmd_demo

    for argv in (["demo", "--models", "A,A"], ["demo", "--models", "A,,B"], ["demo", "--workers", "1", "--models", "A,B"]):
        assert cmd_demo(build_parser().parse_args(argv)) == 2
    assert "--models" in capsys.readouterr().err


def test_the_demo_banner_names_a_model_the_fleet_serves(capsys):
    from serve_app.cli import _print_banner

    _print_banner("http://127.0.0.1:1", RouterConfig(), ["A", "B"])
    out = capsys.readouterr().out
    assert "models: A, B" in out and '"model": "A"' in out and "model='A'" in out and "default" not in out
    _print_banner("http://127.0.0.1:1", RouterConfig())  # names discovered at run time: none in curl
    out = capsys.readouterr().out
    assert '"model"' not in out and "model=client.models.list().data[0].id" in out
