"""Prefill/decode disaggregation on the router (issue 19 item 3, docs/pd.md): the pair is chosen by
the same policies on the prefill and on the decode subset, both requests carry the same bootstrap
fields, the client gets the decode side's answer, and each failure path is handled."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from actors.fleet import FleetError, parse_fleet
from serve_app.breaker import Breakers
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.forward import Forwarder
from serve_app.http import HttpError, Request
from serve_app.metrics import RouterMetrics
from serve_app.pd import (ROOM_MAX, batch_size, bootstrap_host, decide_pair, new_rooms, route_pair,
                          with_bootstrap)
from serve_app.policies import POLICIES, NoWorkerAvailable
from serve_app.proxy import UpstreamClient
from serve_app.router import RouterCore
from tests.serve_app.support import Clock
from tests.serve_app.support import unused_aggregator as _unused
from tests.sim.pd_sims import Sim, free_port, start_sim


def put(core: RouterCore, clock: Clock, name: str, role: str, *, url: str | None = None, port: int | None = None,
        running: int = 0, waiting: int = 0, state: str = "live", models: tuple[str, ...] = ()) -> None:
    m = dict(request_active_slots=running, request_total_slots=64, kv_active_blocks=running * 50,
             kv_total_blocks=4096, num_requests_waiting=waiting, gpu_cache_usage_perc=0.0,
             gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0)
    core.follower.workers[name] = WorkerRecord(
        name=name, url=url or f"http://{name}.local:30000", page_size=16, state=state, healthy=state != "down",
        metrics=m, metrics_at=clock.t, heartbeat_at=clock.t, models=list(models), role=role,
        bootstrap_port=(port or 8998) if role == "prefill" else None)
    core.on_fleet_update([name])


def make_core(**router: Any) -> tuple[RouterCore, Clock]:
    clock = Clock()
    return RouterCore(RouterConfig(**router), FleetFollower(_unused), "r0", clock=clock), clock


def chat(system: str, question: str = "q", **extra: Any) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **extra}


# --- fleet file ---------------------------------------------------------------------------------------


def test_a_prefill_entry_without_bootstrap_port_is_an_error_naming_it():
    with pytest.raises(FleetError, match="p1.*bootstrap_port"):
        parse_fleet({"workers": [{"name": "p1", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/p1",
                                  "role": "prefill"}]}, "fleet.yaml")
    with pytest.raises(FleetError, match="d1.*bootstrap_port is for role: prefill"):
        parse_fleet({"workers": [{"name": "d1", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/d1",
                                  "role": "decode", "bootstrap_port": 8998}]}, "fleet.yaml")
    spec = parse_fleet({"workers": [
        {"name": "p1", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/p1", "role": "prefill",
         "bootstrap_port": 8998},
        {"name": "d1", "url": "http://127.0.0.1:2", "metrics_endpoint": "ipc:///tmp/d1", "role": "decode"},
        {"name": "w", "url": "http://127.0.0.1:3", "metrics_endpoint": "ipc:///tmp/w"}]}, "fleet.yaml")
    assert [(w.role, w.bootstrap_port) for w in spec.workers] == [("prefill", 8998), ("decode", None), ("both", None)]


def test_kvroute_status_shows_the_roles_of_a_pd_fleet():
    from rich.console import Console

    from serve_app.status import render

    core, clock = make_core()
    put(core, clock, "p0", "prefill", port=9100)
    put(core, clock, "d0", "decode")
    console = Console(width=200, record=True)
    console.print(render(core.workers_json()))
    text = console.export_text()
    assert "role" in text and "prefill :9100" in text and "decode" in text


# --- the bootstrap fields ---------------------------------------------------------------------------


def test_bootstrap_fields_are_sglang_routers_host_port_and_a_63_bit_room():
    assert bootstrap_host("http://10.0.0.7:30000") == "10.0.0.7"
    assert bootstrap_host("http://[fd00::19d]:8000") == "fd00::19d"
    assert bootstrap_host("http://prefill-0.svc:30000/") == "prefill-0.svc"
    rng = random.Random(1)
    rooms = new_rooms(rng, None) + new_rooms(rng, 500)
    assert all(0 <= r <= ROOM_MAX for r in rooms) and len(set(rooms)) == len(rooms)
    assert max(rooms) > 2**62  # the whole range, not a small counter
    body = {"model": "m", "prompt": "x"}
    out = with_bootstrap(body, "10.0.0.7", 8998, [5], None)
    assert out == {"model": "m", "prompt": "x", "bootstrap_host": "10.0.0.7", "bootstrap_port": 8998,
                   "bootstrap_room": 5}
    assert "bootstrap_room" not in body  # a copy
    batched = with_bootstrap({"prompt": ["a", "b"]}, "h", 1, [1, 2], 2)
    assert batched["bootstrap_host"] == ["h", "h"] and batched["bootstrap_port"] == [1, 1]
    assert batched["bootstrap_room"] == [1, 2]


def test_batch_size_counts_as_sglang_router_does():
    assert batch_size("/v1/chat/completions", {"n": 3}) == 3
    assert batch_size("/v1/chat/completions", {"n": 1}) is None
    assert batch_size("/v1/completions", {"prompt": ["a", "b"]}) == 2
    assert batch_size("/v1/completions", {"prompt": [1, 2, 3]}) is None  # one tokenized prompt
    assert batch_size("/v1/completions", {"prompt": "a"}) is None
    assert batch_size("/generate", {"text": ["a", "b", "c"]}) == 3
    assert batch_size("/generate", {"input_ids": [[1], [2]]}) == 2
    assert batch_size("/generate", {"input_ids": [1, 2]}) is None


# --- the pair choice ------------------------------------------------------------------------------


def test_the_pair_is_one_prefill_and_one_decode_worker_under_every_policy():
    core, clock = make_core()
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        put(core, clock, name, role, running=random.Random(name).randint(0, 5))
    assert core.disaggregated(None)
    for policy in sorted(POLICIES):
        for i in range(20):
            pair = decide_pair(core, core.facts(chat(f"system {i} " * 30)), policy, None)
            assert pair.prefill.worker in {"p0", "p1"} and pair.decode.worker in {"d0", "d1"}
            assert pair.bootstrap_port == 8998


def test_round_robin_cycles_each_side_on_its_own():
    """One cycle shared by both sides would pair p1 with d0 for ever on a 2+2 fleet."""
    core, clock = make_core(policy="round_robin")
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        put(core, clock, name, role)
    pairs = [(p.worker, d.worker) for p, d in (route_pair(core, core.facts(chat(f"s{i}")), None, None)
                                               for i in range(8))]
    assert {p for p, _ in pairs} == {"p0", "p1"} and {d for _, d in pairs} == {"d0", "d1"}


def test_prefill_side_follows_the_prefix_and_decode_side_the_load():
    """kv_aware on the prefill subset keeps a shared prefix on the prefill worker that has it; on
    the decode subset (no prefix cache there) it takes the less loaded decode worker."""
    core, clock = make_core(policy="kv_aware")
    put(core, clock, "p0", "prefill")
    put(core, clock, "p1", "prefill")
    put(core, clock, "d0", "decode", running=40, waiting=3)
    put(core, clock, "d1", "decode", running=2)
    system = "You are a helpful assistant with a very long shared system prompt. " * 40
    first, dec = route_pair(core, core.facts(chat(system, "first")), None, None)
    assert dec.worker == "d1"
    for i in range(6):
        p, d = route_pair(core, core.facts(chat(system, f"question {i}")), None, None)
        assert p.worker == first.worker, f"request {i} left the prefill worker holding its prefix"
        assert d.request.overlap == {}  # the decode side is never chosen on prefix affinity
    # the ledger counts both sides of every pair
    assert core.ledger.in_flight(first.worker) == 7 and core.ledger.in_flight("d0") + core.ledger.in_flight("d1") == 7


def test_no_decode_or_no_prefill_worker_is_a_503_that_names_the_side():
    core, clock = make_core()
    put(core, clock, "p0", "prefill")
    with pytest.raises(NoWorkerAvailable, match="no routable decode worker.*role: decode"):
        decide_pair(core, core.facts(chat("x")), None, None)
    assert core.ledger.in_flight("p0") == 0  # the prefill side is not left booked
    fwd = _forwarder(core, None)
    with pytest.raises(HttpError) as err:
        asyncio.run(fwd.forward(_request(), _Sink(), "/v1/chat/completions", b"{}", chat("x")))
    assert err.value.status == 503 and "decode worker" in str(err.value.body())
    core2, clock2 = make_core()
    put(core2, clock2, "d0", "decode")
    put(core2, clock2, "p0", "prefill", state="down")
    with pytest.raises(NoWorkerAvailable, match="prefill"):
        decide_pair(core2, core2.facts(chat("x")), None, None)
    # no prefill worker at all: the client's 503 names the missing side
    core3, clock3 = make_core()
    put(core3, clock3, "d0", "decode")
    with pytest.raises(HttpError) as err:
        asyncio.run(_forwarder(core3, None).forward(_request(), _Sink(), "/v1/chat/completions", b"{}", chat("x")))
    msg = json.loads(err.value.body())["error"]["message"]
    assert err.value.status == 503 and "no routable prefill worker" in msg and "role: prefill" in msg, msg
    assert core3.ledger.in_flight("d0") == 0


def test_only_the_models_pd_workers_pair_and_other_models_route_as_before():
    core, clock = make_core()
    put(core, clock, "p0", "prefill", models=("big",))
    put(core, clock, "d0", "decode", models=("big",))
    put(core, clock, "w0", "both", models=("small",))
    assert core.disaggregated("big") and not core.disaggregated("small")
    pair = decide_pair(core, core.facts(chat("x")), None, "big")
    assert (pair.prefill.worker, pair.decode.worker) == ("p0", "d0")
    assert core.route(core.facts(chat("x")), model="small").worker == "w0"


# --- end to end: the router's request path through simulated prefill and decode servers -----------------


class _Sink:
    """An ASGI `send` that keeps what the router answered."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""

    async def __call__(self, msg: dict) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = {k.decode(): v.decode() for k, v in msg["headers"]}
        else:
            self.body += msg.get("body", b"")


def _request() -> Request:
    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": [(b"content-type", b"application/json")]}, receive)


def _forwarder(core: RouterCore, upstream: UpstreamClient | None) -> Forwarder:
    breakers = Breakers(core.config.breaker)
    return Forwarder(core, upstream, breakers, RouterMetrics(core, breakers), core.config)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sims():
    p = start_sim("prefill", timeout_s=30)
    d = start_sim("decode", timeout_s=30)
    yield p, d
    p.stop()
    d.stop()


def _serve(core: RouterCore, body: dict, metrics: list[RouterMetrics] | None = None) -> _Sink:
    """One request through a fresh forwarder (its RouterMetrics appended to `metrics` if given)."""
    async def go() -> _Sink:
        up = UpstreamClient(connect_timeout_s=2, read_timeout_s=20)
        sink = _Sink()
        fwd = _forwarder(core, up)
        if metrics is not None:
            metrics.append(fwd.metrics)
        try:
            await fwd.forward(_request(), sink, "/v1/chat/completions", json.dumps(body).encode(), body)
            await asyncio.sleep(0.3)  # the prefill answer is read to its end in the background
        finally:
            await up.aclose()
        return sink
    return asyncio.run(go())


def _pd_core(p: Sim, d: Sim, **extra_workers: tuple[str, dict]) -> tuple[RouterCore, Clock]:
    core, clock = make_core(policy="kv_aware", max_attempts=3)
    put(core, clock, "p0", "prefill", url=p.url, port=p.bootstrap_port, running=20, waiting=10)
    put(core, clock, "d0", "decode", url=d.url, running=30, waiting=10)
    for name, (role, kw) in extra_workers.items():
        put(core, clock, name, role, **kw)
    return core, clock


def _tokens(sse: bytes) -> list[str]:
    out = []
    for line in sse.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    return [t for t in out if t]


def test_a_pd_request_completes_through_both_sims_with_matching_bootstrap_fields(sims):
    p, d = sims
    core, _ = _pd_core(p, d)
    before_p, before_d = p.stats()["transfers"], d.stats()["received"]
    sink = _serve(core, chat("a PD request " * 30, stream=True, max_tokens=7))
    assert sink.status == 200, sink.body
    assert sink.headers["x-kvroute-worker"] == "d0" and sink.headers["x-kvroute-prefill-worker"] == "p0"
    assert len(_tokens(sink.body)) == 7 and sink.body.rstrip().endswith(b"[DONE]")
    ps, ds = p.stats(), d.stats()
    assert ps["transfers"] == before_p + 1 and ds["received"] == before_d + 1
    assert ps["recent_rooms"][-1] == ds["recent_rooms"][-1]  # the same room on both sides
    assert core.ledger.in_flight("p0") == 0 and core.ledger.in_flight("d0") == 0
    # non-streamed: the decode side's whole answer
    sink = _serve(core, chat("another PD request " * 30, max_tokens=4))
    assert sink.status == 200 and json.loads(sink.body)["usage"]["completion_tokens"] == 4


def test_a_prefill_worker_that_is_down_before_the_first_byte_makes_the_pair_retry(sims):
    p, d = sims
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused, as a prefill server that died
    core, _ = _pd_core(p, d, p_dead=("prefill", {"url": dead, "port": free_port()}))  # idle: chosen first
    assert decide_pair(core, core.facts(chat("retry me " * 30)), None, None).prefill.worker == "p_dead"
    sink = _serve(core, chat("retry me " * 30, stream=True, max_tokens=3))
    assert sink.status == 200 and sink.headers["x-kvroute-prefill-worker"] == "p0"
    assert len(_tokens(sink.body)) == 3
    assert core.ledger.in_flight("p_dead") == 0 and core.ledger.in_flight("d0") == 0


def test_a_decode_worker_that_is_down_before_the_first_byte_makes_the_pair_retry(sims):
    p, d = sims
    core, _ = _pd_core(p, d, d_dead=("decode", {"url": f"http://127.0.0.1:{free_port()}"}))
    sink = _serve(core, chat("decode retry " * 30, max_tokens=3))
    assert sink.status == 200, sink.body
    assert sink.headers["x-kvroute-worker"] == "d0"
    assert p.stats()["recent_rooms"][-1] == d.stats()["recent_rooms"][-1]  # the retried pair met in its room
    assert core.ledger.in_flight("d_dead") == 0


def test_every_pair_failing_is_a_503_naming_the_attempts(sims):
    p, _ = sims
    core, clock = make_core(max_attempts=2)
    put(core, clock, "p0", "prefill", url=p.url, port=p.bootstrap_port)
    put(core, clock, "d_dead", "decode", url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(HttpError) as err:
        _serve(core, chat("nobody decodes " * 10, max_tokens=2))
    assert err.value.status == 503 and "decode worker d_dead" in err.value.body().decode()


def test_the_request_counter_carries_the_model_of_a_pd_request(sims):
    p, d = sims
    core, clock = make_core(policy="kv_aware")
    put(core, clock, "p0", "prefill", url=p.url, port=p.bootstrap_port, models=("M",))
    put(core, clock, "d0", "decode", url=d.url, models=("M",))
    put(core, clock, "w0", "both", models=("other",))
    metrics: list[RouterMetrics] = []
    sink = _serve(core, chat("counted per model " * 20, model="M", stream=True, max_tokens=2), metrics)
    assert sink.status == 200, sink.body
    text = metrics[0].render().decode()
    assert 'kvroute_requests_total{model="M",outcome="ok",policy="kv_aware",worker="d0"} 1.0' in text


def test_a_prefill_worker_that_dies_mid_request_makes_the_pair_retry(sims):
    """The prefill side's 200 has gone out (a streamed request) and then its server dies during the
    prefill: before the decode side's first byte, so the decode request is dropped and the pair
    retried on the other prefill worker (sglang-router would leave the decode side waiting 300 s)."""
    import threading

    p, d = sims
    slow = start_sim("prefill", timeout_s=30, extra=["--prefill-per-token-us", "200000"])  # ~2.5 s wall per prompt
    try:
        core, _ = _pd_core(p, d, p_slow=("prefill", {"url": slow.url, "port": slow.bootstrap_port}))
        assert decide_pair(core, core.facts(chat("dies mid-way " * 40)), None, None).prefill.worker == "p_slow"
        killer = threading.Timer(0.5, slow.proc.kill)
        killer.start()
        sink = _serve(core, chat("dies mid-way " * 40, stream=True, max_tokens=3))
        killer.join()
        assert sink.status == 200, sink.body
        assert sink.headers["x-kvroute-prefill-worker"] == "p0" and len(_tokens(sink.body)) == 3
        assert core.ledger.in_flight("p_slow") == 0 and core.ledger.in_flight("d0") == 0
    finally:
        slow.stop()


# --- attention-DP ranks inside a PD pair (docs/pd.md, "DP ranks in a PD pair") ------------------------------


def put_dp(core: RouterCore, clock: Clock, name: str, role: str, running: list[int], *, url: str | None = None,
           port: int | None = None) -> None:
    """A PD worker with one attention-DP rank per entry of `running` (each rank's own KvMetrics)."""
    ranks = [dict(request_active_slots=r, request_total_slots=64, kv_active_blocks=r * 50, kv_total_blocks=4096,
                  num_requests_waiting=r // 3, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0,
                  data_parallel_rank=i) for i, r in enumerate(running)]
    core.follower.workers[name] = WorkerRecord(
        name=name, url=url or f"http://{name}.local:30000", page_size=16, state="live", healthy=True,
        metrics=ranks[0], ranks=ranks, metrics_at=clock.t, heartbeat_at=clock.t, dp_size=len(running),
        rank_at={i: clock.t for i in range(len(running))}, role=role,
        bootstrap_port=(port or 8998) if role == "prefill" else None)
    core.on_fleet_update([name])


def test_each_side_of_the_pair_is_a_worker_and_rank_chosen_by_the_same_policy():
    from serve_app.dp_ranks import PREFILL_RANK_FIELD

    for policy in ("kv_aware", "least_loaded"):
        core, clock = make_core(policy=policy)
        put_dp(core, clock, "p0", "prefill", [40, 0])  # rank 1 idle
        put_dp(core, clock, "d0", "decode", [0, 40])  # rank 0 idle
        pair = decide_pair(core, core.facts(chat("ranks " * 20)), None, None)
        assert (pair.prefill.worker, pair.prefill.rank, pair.decode.worker, pair.decode.rank) == ("p0", 1, "d0", 0)
        route = pair.as_json()
        assert route["rank"] == 0 and route["prefill"]["rank"] == 1 and route["decode"]["rank"] == 0
    # booked per (worker, rank) on both sides, released per (worker, rank)
    p, d = route_pair(core, core.facts(chat("ranks " * 20)), None, None)
    assert core.ledger.in_flight("p0@1") == 1 and core.ledger.in_flight("d0@0") == 1
    assert core.ledger.in_flight("p0@0") == 0 and core.in_flight("p0") == 1
    p.finished()
    d.failed()
    assert core.in_flight("p0") == 0 and core.in_flight("d0") == 0
    assert PREFILL_RANK_FIELD == "disagg_prefill_dp_rank"


def test_the_pair_bodies_pin_each_side_as_sglang_routers_pd_mode_with_dp_ranks_does():
    from serve_app.dp_ranks import pd_headers
    from serve_app.pd import pair_bodies

    body = chat("x", data_parallel_rank=5, stream=True)
    p, d = (json.loads(b) for b in pair_bodies(body, "10.0.0.1", 8998, [7], None, 1, 0))
    assert (p["routed_dp_rank"], p["data_parallel_rank"]) == (1, 1) and "disagg_prefill_dp_rank" not in p
    assert (d["routed_dp_rank"], d["data_parallel_rank"], d["disagg_prefill_dp_rank"]) == (0, 0, 1)
    assert p["bootstrap_room"] == d["bootstrap_room"] == 7 and p["bootstrap_host"] == d["bootstrap_host"] == "10.0.0.1"
    # a DP prefill and a plain decode: the decode side still learns the prefill rank, pins none of its own
    p, d = (json.loads(b) for b in pair_bodies(chat("x"), "h", 1, [7], None, 2, None))
    assert p["routed_dp_rank"] == 2 and "routed_dp_rank" not in d and d["disagg_prefill_dp_rank"] == 2
    # no ranks: the same bytes to both, no rank field
    p_raw, d_raw = pair_bodies(chat("x"), "h", 1, [7], None, None, None)
    assert p_raw is d_raw and b"dp_rank" not in p_raw
    assert pd_headers({"x-override-routed-dp-rank": "1", "X-Data-Parallel-Rank": "1",
                       "x-override-disagg-prefill-dp-rank": "0", "authorization": "k"}) == {"authorization": "k"}


def test_rooms_follow_the_prefill_rank_modulo_its_dp_size():
    rng = random.Random(3)
    for rank, dp in ((0, 2), (1, 2), (3, 4), (6, 7)):
        rooms = new_rooms(rng, 50, rank, dp)
        assert all(r % dp == rank and 0 <= r <= ROOM_MAX for r in rooms) and len(set(rooms)) == 50
    assert len({r % 2 for r in new_rooms(rng, 64)}) == 2  # no rank: unconstrained


@pytest.fixture(scope="module")
def dp_sims():
    p = start_sim("prefill", timeout_s=20, extra=["--dp-size", "2"])  # 2 s wall: room for a loaded machine
    d = start_sim("decode", timeout_s=20, extra=["--dp-size", "2"])
    yield p, d
    p.stop()
    d.stop()


def _rank_finished(sim: Sim) -> list[int]:
    import httpx

    return [r["requests_finished_total"] for r in httpx.get(sim.url + "/sim/stats", timeout=5).json()["ranks"]]


def test_a_pd_request_with_dp_ranks_reaches_the_chosen_prefill_rank_and_decode_rank(dp_sims):
    """Four requests, each chosen for prefill rank 1 and decode rank 1 (the other ranks look busy):
    unpinned, the decode sim's round robin could not serve two in a row on rank 1, and the prefill
    sim would serve each on the rank its random room implies."""
    p, d = dp_sims
    core, clock = make_core(policy="kv_aware", max_attempts=2)
    put_dp(core, clock, "p0", "prefill", [40, 0], url=p.url, port=p.bootstrap_port)
    put_dp(core, clock, "d0", "decode", [40, 0], url=d.url)
    p0, d0 = _rank_finished(p), _rank_finished(d)
    for i in range(4):
        sink = _serve(core, chat(f"DP ranks in a PD pair {i} " * 20, stream=i % 2 == 0, max_tokens=3))
        assert sink.status == 200, sink.body
        assert sink.headers["x-kvroute-worker"] == "d0" and sink.headers["x-kvroute-rank"] == "1"
        assert sink.headers["x-kvroute-prefill-worker"] == "p0" and sink.headers["x-kvroute-prefill-rank"] == "1"
    assert _rank_finished(p) == [p0[0], p0[1] + 4] and _rank_finished(d) == [d0[0], d0[1] + 4]
    ps, ds = p.stats(), d.stats()
    assert ps["recent_ranks"][-4:] == [1] * 4 and ps["rank_conflicts"] == 0
    assert ds["recent_prefill_ranks"][-4:] == [1] * 4 and ds["recent_rooms"][-4:] == ps["recent_rooms"][-4:]
    assert all(core.ledger.in_flight(t) == 0 for t in ("p0@0", "p0@1", "d0@0", "d0@1"))


def test_a_dead_dp_prefill_worker_makes_the_pair_retry_on_another_worker_and_rank(dp_sims):
    p, d = dp_sims
    core, clock = make_core(policy="kv_aware", max_attempts=3)
    put_dp(core, clock, "p0", "prefill", [8, 40], url=p.url, port=p.bootstrap_port)  # rank 0 the less busy
    put_dp(core, clock, "p_dead", "prefill", [0, 0], url=f"http://127.0.0.1:{free_port()}", port=free_port())
    put_dp(core, clock, "d0", "decode", [0, 40], url=d.url)
    assert decide_pair(core, core.facts(chat("retry ranks " * 30)), None, None).prefill.worker == "p_dead"
    sink = _serve(core, chat("retry ranks " * 30, stream=True, max_tokens=3))
    assert sink.status == 200, sink.body
    assert sink.headers["x-kvroute-prefill-worker"] == "p0" and sink.headers["x-kvroute-prefill-rank"] == "0"
    assert sink.headers["x-kvroute-rank"] == "0" and len(_tokens(sink.body)) == 3
    assert core.in_flight("p_dead") == 0 and core.in_flight("d0") == 0


def test_prometheus_carries_each_ranks_load_and_in_flight_and_each_workers_role():
    core, clock = make_core()
    put_dp(core, clock, "p0", "prefill", [4, 9])
    put_dp(core, clock, "d0", "decode", [0, 6])
    put(core, clock, "w", "both")  # a plain worker: no per-rank series, no role series
    p, d = route_pair(core, core.facts(chat("metrics " * 20)), None, None)
    text = RouterMetrics(core, Breakers(core.config.breaker)).render().decode()

    def series(name: str) -> dict[str, float]:
        return {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith(name + "{")}

    assert series("kvroute_worker_rank_running_requests") == {
        'rank="0",worker="p0"': 4, 'rank="1",worker="p0"': 9, 'rank="0",worker="d0"': 0, 'rank="1",worker="d0"': 6}
    assert series("kvroute_worker_rank_waiting_requests")['rank="1",worker="p0"'] == 3
    inflight = series("kvroute_worker_rank_in_flight_requests")
    assert inflight[f'rank="{p.decision.rank}",worker="p0"'] == 1 and inflight[f'rank="{d.decision.rank}",worker="d0"'] == 1
    assert sum(inflight.values()) == 2
    assert series("kvroute_worker_role") == {'role="prefill",worker="p0"': 1, 'role="decode",worker="d0"': 1}
    assert series("kvroute_worker_in_flight_requests")['worker="p0"'] == 1  # the per-worker series stay
