"""`--dp-size N`: N attention-DP ranks behind one simulated server (issue 19, item 2).

Each rank is its own scheduler (engine, KV pool, loop), sends KvMetrics with its
`data_parallel_rank` to the one metrics address and KV events on the endpoint offset by its rank;
a request pins a rank as the claimed SGLang release reads it (`sim.dp`), else ranks take turns.
"""

from __future__ import annotations

import uuid

import pytest
import zmq
from fastapi.testclient import TestClient

from actors.wire import decode_kv_metrics
from sim.config import EngineConfig, SimConfig
from sim.dp import DpController, requested_rank
from sim.kv_events import decode_batch
from sim.protocol import BadRequest, ChatCompletionRequest, GenerateRequest
from sim.server import SimServer

_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
_GEN = {"text": "hello there", "sampling_params": {"max_new_tokens": 2}}


def _server(wire: str = "0.5.23", dp_size: int = 2, **kw) -> SimServer:
    return SimServer(SimConfig(wire=wire, model_name="m", time_scale=0.01, dp_size=dp_size, **kw))


def _served(server: SimServer) -> list[int]:
    """Requests finished per rank (the sim's own per-rank counters)."""
    return [e.stats().requests_finished_total for e in server.engines]


def test_each_rank_has_its_own_engine_pool_and_rank_number():
    server = _server(dp_size=3)
    try:
        assert [e.config.dp_rank for e in server.engines] == [0, 1, 2]
        assert len({id(e.pool) for e in server.engines}) == 3
        with TestClient(server.app) as c:
            info = c.get("/get_server_info").json()
            assert info["dp_size"] == 3 and info["enable_dp_attention"] is True
            assert [r["dp_rank"] for r in c.get("/sim/stats").json()["ranks"]] == [0, 1, 2]
    finally:
        server.close()


@pytest.mark.parametrize("wire", ["0.5.23", "0.5.14"])
@pytest.mark.parametrize("field", ["routed_dp_rank", "data_parallel_rank"])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", _CHAT), ("/generate", _GEN),
                                       ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})])
def test_a_pinned_rank_serves_the_request(wire, field, path, body):
    server = _server(wire)
    try:
        with TestClient(server.app) as c:
            for _ in range(3):
                assert c.post(path, json={**body, field: 1}).status_code == 200
            assert _served(server) == [0, 3]
    finally:
        server.close()


def test_generate_meta_info_names_the_serving_rank_from_0_5_14():
    for wire, has in (("0.5.23", True), ("0.5.14", True), ("0.4.9", False)):
        server = _server(wire)
        try:
            with TestClient(server.app) as c:
                meta = c.post("/generate", json={**_GEN, "data_parallel_rank": 1}).json()["meta_info"]
                assert meta.get("dp_rank") == (1 if has else None), wire
        finally:
            server.close()


def test_unpinned_requests_take_turns_over_the_ranks():
    server = _server(dp_size=3)
    try:
        with TestClient(server.app) as c:
            for _ in range(6):
                assert c.post("/v1/chat/completions", json=_CHAT).status_code == 200
            assert _served(server) == [2, 2, 2]
    finally:
        server.close()


def test_an_out_of_range_rank_is_sglangs_400():
    server = _server()
    try:
        with TestClient(server.app) as c:
            r = c.post("/v1/chat/completions", json={**_CHAT, "routed_dp_rank": 2})
            assert r.status_code == 400
            assert r.json()["message"] == "routed_dp_rank=2 out of range [0, 2)"
            r = c.post("/generate", json={**_GEN, "data_parallel_rank": -1})
            assert r.status_code == 400 and r.json() == {"error": {"message": "routed_dp_rank=-1 out of range [0, 2)"}}
            assert _served(server) == [0, 0]
    finally:
        server.close()


def test_rank_zero_on_a_server_without_dp_is_ignored_and_others_refused():
    server = _server(dp_size=1)
    try:
        with TestClient(server.app) as c:
            assert c.post("/generate", json={**_GEN, "routed_dp_rank": 0}).status_code == 200
            assert c.post("/generate", json={**_GEN, "routed_dp_rank": 1}).status_code == 400
    finally:
        server.close()


def test_release_rules_for_reading_the_rank():
    chat = ChatCompletionRequest.model_validate({**_CHAT, "routed_dp_rank": 1, "data_parallel_rank": 0})
    assert requested_rank("0.5.23", "chat", chat, {}) == 1  # routed_dp_rank wins over the alias
    assert requested_rank("0.5.23", "chat", chat, {"x-data-parallel-rank": "0"}) == 0  # the header wins
    with pytest.raises(BadRequest, match="Invalid X-Data-Parallel-Rank header"):
        requested_rank("0.5.14", "chat", chat, {"x-data-parallel-rank": "x"})
    gen = GenerateRequest.model_validate({**_GEN, "data_parallel_rank": 1, "routed_dp_rank": None})
    assert requested_rank("0.5.23", "generate", gen, {"x-override-routed-dp-rank": "0"}) == 0
    assert requested_rank("0.5.14", "generate", gen, {"x-override-routed-dp-rank": "0"}) == 1  # 0.5.23 only
    # 0.4.9: data_parallel_rank on /generate only, routed_dp_rank unknown
    assert requested_rank("0.4.9", "generate", gen, {}) == 1
    assert requested_rank("0.4.9", "chat", chat, {}) is None
    assert requested_rank("0.4.9", "generate", GenerateRequest.model_validate({**_GEN, "routed_dp_rank": 1}), {}) is None


def test_controller_checks_ranges_and_keeps_health_turns_apart():
    dp = DpController(2, "0.4.9")
    with pytest.raises(BadRequest, match=r"data_parallel_rank=5 out of range \[0, 2\)"):
        dp.choose(5)
    assert [dp.choose(None), dp.choose(None, health=True), dp.choose(None)] == [0, 0, 1]


def test_loads_has_one_entry_per_rank_and_filters_like_sglang():
    server = _server(dp_size=2)
    try:
        with TestClient(server.app) as c:
            assert [x["dp_rank"] for x in c.get("/v1/loads").json()["loads"]] == [0, 1]
            assert [x["dp_rank"] for x in c.get("/v1/loads", params={"dp_rank": 1}).json()["loads"]] == [1]
            assert c.get("/v1/loads", params={"dp_rank": 7}).json()["loads"] == []
    finally:
        server.close()
    server = _server("0.5.20", dp_size=2)
    try:
        with TestClient(server.app) as c:
            assert [x["dp_rank"] for x in c.get("/get_load").json()] == [0, 1]
    finally:
        server.close()


def test_dp_rank_flag_is_refused_with_dp_size():
    with pytest.raises(ValueError, match="ranks are 0..dp_size-1"):
        SimConfig(dp_size=2, engine=EngineConfig(dp_rank=1))


def test_every_rank_pushes_kv_metrics_to_the_one_address_and_publishes_on_its_own_port(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    metrics_ep = f"ipc://{tmp_path}/m-{uuid.uuid4().hex[:6]}"
    pull.bind(metrics_ep)
    subs = []
    for _ in range(2):  # SGLang 0.5.23's PUB connects to a concrete tcp address: the subscriber binds
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        subs.append(s)
    port = subs[0].bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=40000)
    try:
        subs[1].bind(f"tcp://127.0.0.1:{port + 1}")
    except zmq.ZMQError:
        pytest.skip("port + 1 is taken")
    server = _server(metrics_endpoint=metrics_ep, kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                     engine=EngineConfig(page_size=4))
    try:
        with TestClient(server.app) as c:
            ranks_seen, batch_ranks = set(), {}
            # a connecting PUB drops what it sends before the subscription reached it (as SGLang's
            # does): keep sending to each rank until both subscribers heard a batch
            for i in range(50):
                for rank in (0, 1):
                    ids = list(range(1000 + 64 * i + 32 * rank, 1000 + 64 * i + 32 * rank + 16))
                    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "routed_dp_rank": rank}
                    assert c.post("/generate", json=body).status_code == 200
                while pull.poll(20):
                    ranks_seen.add(decode_kv_metrics(pull.recv()).data_parallel_rank)
                for k, sub in enumerate(subs):
                    while sub.poll(20):
                        _, _, payload = sub.recv_multipart()
                        batch_ranks.setdefault(k, set()).add(decode_batch(payload)[2])
                if len(batch_ranks) == 2 and len(ranks_seen) == 2:
                    break
            assert ranks_seen == {0, 1}
            assert batch_ranks == {0: {0}, 1: {1}}  # rank r's batches on port + r, carrying rank r
    finally:
        server.close()
        for s in (pull, *subs):
            s.close(0)
        ctx.term()


def test_dp_ranks_with_a_pd_role_need_a_release_that_reads_the_pd_rank_fields():
    from sim.config import SimConfig
    from sim.disagg import DisaggConfig

    cfg = SimConfig(dp_size=2, disagg=DisaggConfig(mode="prefill"))
    assert cfg.balance_method == "follow_bootstrap_room"  # SGLang's `auto` on a PD prefill server
    assert SimConfig(dp_size=2, disagg=DisaggConfig(mode="decode")).balance_method == "round_robin"
    with pytest.raises(ValueError, match="needs wire 0.5.14 or later"):
        SimConfig(dp_size=2, disagg=DisaggConfig(mode="decode"), wire="0.4.9")
    with pytest.raises(ValueError, match="follow_bootstrap_room is for a PD prefill server"):
        SimConfig(dp_size=2, load_balance_method="follow_bootstrap_room")
