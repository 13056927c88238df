"""The simulator's prefill/decode disaggregation (sim.disagg): the bootstrap rendezvous per room, the
modelled KV transfer, SGLang's refusals and timeouts for requests that reach only one side."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from sim.disagg import DisaggConfig
from tests.sim.pd_sims import start_sim


@pytest.fixture(scope="module")
def pair():
    """A prefill and a decode sim, 10× faster than real time, with 2 s (simulated) PD timeouts."""
    p = start_sim("prefill", timeout_s=2.0)
    d = start_sim("decode", timeout_s=2.0)
    yield p, d
    p.stop()
    d.stop()


def _body(room: int, prefill, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "tell me about disaggregation " * 20}], "max_tokens": 6,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room,
            **extra}


def test_a_request_sent_to_both_sides_is_decoded_from_the_prefill_servers_kv(pair):
    p, d = pair
    room = 2**62 + 17
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        dec = ex.submit(httpx.post, d.url + "/v1/chat/completions", json=_body(room, p, stream=True), timeout=20)
        time.sleep(0.1)  # decode first: it waits for the room, as SGLang's does
        pre = ex.submit(httpx.post, p.url + "/v1/chat/completions", json=_body(room, p), timeout=20)
        dr, pr = dec.result(), pre.result()
    assert pr.status_code == 200 and dr.status_code == 200
    assert pr.json()["usage"]["completion_tokens"] == 1  # the prefill server computes the prompt and one token
    events = [line[6:] for line in dr.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert len([t for t in tokens if t]) == 6
    assert room in p.stats()["recent_rooms"] and room in d.stats()["recent_rooms"]


def test_prefill_first_then_decode_also_meets_in_the_room(pair):
    p, d = pair
    room = 4242
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        pre = ex.submit(httpx.post, p.url + "/generate",
                        json={"text": "x " * 300, "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
                              "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}, timeout=20)
        time.sleep(0.1)
        dec = ex.submit(httpx.post, d.url + "/generate",
                        json={"text": "x " * 300, "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
                              "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}, timeout=20)
        pr, dr = pre.result(), dec.result()
    assert pr.status_code == 200 and dr.status_code == 200
    assert len(dr.json()["output_ids"]) == 4


def test_a_request_only_the_decode_side_gets_times_out_like_sglangs(pair):
    p, d = pair
    before = d.stats()["waiting_timeouts"]
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/chat/completions", json=_body(777001, p), timeout=20)
    took = time.monotonic() - t0
    assert r.status_code == 500
    assert "KVPoll.WaitingForInput" in r.json()["message"] and "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" in r.json()["message"]
    assert 0.15 <= took < 5  # 2 simulated seconds at time scale 0.1
    assert d.stats()["waiting_timeouts"] == before + 1
    # streamed: SGLang's error event, then [DONE]
    r = httpx.post(d.url + "/v1/chat/completions", json=_body(777002, p, stream=True), timeout=20)
    assert r.status_code == 200
    assert '"error"' in r.text and "KVPoll.WaitingForInput" in r.text and r.text.rstrip().endswith("[DONE]")


def test_a_request_only_the_prefill_side_gets_times_out_like_sglangs(pair):
    p, _ = pair
    before = p.stats()["bootstrap_timeouts"]
    r = httpx.post(p.url + "/v1/completions", json={"prompt": "only prefill " * 10, "max_tokens": 3,
                                                    "bootstrap_room": 55}, timeout=20)
    assert r.status_code == 500
    assert "KVPoll.Bootstrapping" in r.json()["message"]
    stats = p.stats()
    assert stats["bootstrap_timeouts"] == before + 1 and stats["open_rooms"] == 0


def test_a_pd_request_without_a_bootstrap_room_is_refused_with_sglangs_message(pair):
    p, d = pair
    for url in (p.url, d.url):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=5)
        assert r.status_code == 400
        assert "without bootstrap room id" in r.text
    r = httpx.post(d.url + "/generate", json={"text": "hi", "bootstrap_room": 3}, timeout=5)
    assert r.status_code == 400 and "bootstrap_host" in r.text


def test_decode_side_unable_to_reach_the_bootstrap_server_fails_the_request(pair):
    _, d = pair
    r = httpx.post(d.url + "/generate", json={"text": "hi", "bootstrap_room": 3, "bootstrap_host": "127.0.0.1",
                                             "bootstrap_port": 9}, timeout=10)
    assert r.status_code == 500 and "cannot reach the bootstrap server" in r.text


def test_transfer_time_grows_with_the_uncached_prompt():
    """Configured rate: 5 µs per uncached token → a 10k-token prompt's transfer adds 50 ms (simulated)."""
    c = DisaggConfig(mode="prefill")
    assert c.transfer_base_s + c.transfer_per_token_s * 10_000 == pytest.approx(0.051)
    assert DisaggConfig(mode="decode").waiting_timeout_s == 300.0


# --- attention-DP ranks on both sides (SGLang 0.5.14+: routed_dp_rank, disagg_prefill_dp_rank) ------------


@pytest.fixture(scope="module")
def dp_pair():
    """A prefill and a decode sim with 2 DP ranks each (10 s simulated PD timeouts: 1 s wall, room for
    a loaded machine), plus a prefill sim whose ranks do not follow the room (round_robin: ranks
    register rooms with the bootstrap server)."""
    p = start_sim("prefill", timeout_s=10.0, extra=["--dp-size", "2"])
    d = start_sim("decode", timeout_s=10.0, extra=["--dp-size", "2"])
    rr = start_sim("prefill", timeout_s=10.0, extra=["--dp-size", "2", "--load-balance-method", "round_robin"])
    yield p, d, rr
    for s in (p, d, rr):
        s.stop()


def _both(p, d, prefill_body: dict, decode_body: dict) -> tuple[httpx.Response, httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        dec = ex.submit(httpx.post, d.url + "/generate", json=decode_body, timeout=20)
        pre = ex.submit(httpx.post, p.url + "/generate", json=prefill_body, timeout=20)
        return pre.result(), dec.result()


def _gen(room: int, prefill, **extra) -> dict:
    return {"text": "dp ranks in a pd pair " * 20, "sampling_params": {"max_new_tokens": 3}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room, **extra}


def _rank_counts(sim) -> list[int]:
    return [r["requests_finished_total"] for r in httpx.get(sim.url + "/sim/stats", timeout=5).json()["ranks"]]


def test_pinned_ranks_on_both_sides_serve_the_pair_on_exactly_those_ranks(dp_pair):
    p, d, _ = dp_pair
    room = 1000 * 2 + 1  # room % 2 == 1: the prefill rank the room implies
    p0, d0 = _rank_counts(p), _rank_counts(d)
    pr, dr = _both(p, d, _gen(room, p, routed_dp_rank=1), _gen(room, p, routed_dp_rank=0, disagg_prefill_dp_rank=1))
    assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
    assert dr.json()["meta_info"]["dp_rank"] == 0 and pr.json()["meta_info"]["dp_rank"] == 1
    assert _rank_counts(p) == [p0[0], p0[1] + 1] and _rank_counts(d) == [d0[0] + 1, d0[1]]
    ps, ds = p.stats(), d.stats()
    assert ps["recent_rooms"][-1] == room and ps["recent_ranks"][-1] == 1
    assert ds["recent_rooms"][-1] == room and ds["recent_prefill_ranks"][-1] == 1


def test_an_unnamed_prefill_rank_is_found_from_the_room_as_sglangs_decode_does(dp_pair):
    p, d, _ = dp_pair
    room = 4444  # even: prefill rank 0 by follow_bootstrap_room; the decode side computes the same
    pr, dr = _both(p, d, _gen(room, p), _gen(room, p, routed_dp_rank=1))
    assert pr.status_code == 200 and dr.status_code == 200
    assert pr.json()["meta_info"]["dp_rank"] == 0 and dr.json()["meta_info"]["dp_rank"] == 1
    assert d.stats()["recent_prefill_ranks"][-1] == 0


def test_a_prefill_rank_against_the_room_fails_like_sglangs_follow_bootstrap_room_conflict(dp_pair):
    p, _, _ = dp_pair
    before = p.stats()["rank_conflicts"]
    r = httpx.post(p.url + "/generate", json=_gen(4446, p, routed_dp_rank=1), timeout=10)  # 4446 % 2 == 0
    assert r.status_code == 500 and "follow_bootstrap_room conflict" in r.text
    assert p.stats()["rank_conflicts"] == before + 1


def test_a_decode_side_told_the_wrong_prefill_rank_times_out_on_both_sides(dp_pair):
    p, d, _ = dp_pair
    pb, db = p.stats()["bootstrap_timeouts"], d.stats()["waiting_timeouts"]
    room = 9001  # odd: the prefill serves it on rank 1; the decode side is told rank 0
    pr, dr = _both(p, d, _gen(room, p), _gen(room, p, disagg_prefill_dp_rank=0))
    assert pr.status_code == 500 and "KVPoll.Bootstrapping" in pr.text
    assert dr.status_code == 500 and "KVPoll.WaitingForInput" in dr.text
    assert p.stats()["bootstrap_timeouts"] == pb + 1 and d.stats()["waiting_timeouts"] == db + 1


def test_a_prefill_server_that_does_not_follow_the_room_registers_it_for_the_decode_side(dp_pair):
    _, d, rr = dp_pair
    results = [_both(rr, d, _gen(room, rr), _gen(room, rr)) for room in (7000, 7002)]  # both even
    assert all(pr.status_code == 200 and dr.status_code == 200 for pr, dr in results)
    # round robin put the two rooms on different prefill ranks, whatever the room says; the decode
    # side asked the bootstrap server (/query_dp_ranks) and met each on its rank
    assert sorted(pr.json()["meta_info"]["dp_rank"] for pr, _ in results) == [0, 1]
    assert d.stats()["recent_prefill_ranks"][-2:] == [pr.json()["meta_info"]["dp_rank"] for pr, _ in results]


def test_a_decode_request_waiting_for_its_kv_holds_the_prompts_pages_as_sglangs_prealloc_queue_does():
    p = start_sim("prefill", timeout_s=60.0)
    d = start_sim("decode", timeout_s=60.0)  # 6 s wall: time to look at the decode side while it waits
    try:
        def used() -> int:
            return httpx.get(d.url + "/sim/stats", timeout=5).json()["used_tokens"]

        body = {"text": "x " * 500, "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.bootstrap_port, "bootstrap_room": 31337}
        assert used() == 0
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            dec = ex.submit(httpx.post, d.url + "/generate", json=body, timeout=30)
            deadline = time.monotonic() + 5
            while used() == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            held = used()
            assert held > 0 and held % 16 == 0  # whole pages, before any KV has come
            assert httpx.get(d.url + "/sim/stats", timeout=5).json()["num_running_reqs"] == 0
            pr = httpx.post(p.url + "/generate", json=body, timeout=30)  # now the KV comes
            assert pr.status_code == 200 and dec.result().status_code == 200
        assert used() == 0  # admitted into those pages, finished, cached
    finally:
        p.stop()
        d.stop()
