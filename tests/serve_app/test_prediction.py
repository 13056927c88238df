"""The router checks its own predictions (issue 33, item 3) and explains its routes (item 4): usage
read from JSON bodies and stream tails, the usage chunk asked for upstream and never relayed unasked,
counters, /workers rates, a warning on divergence (a deliberately wrong page size, a wrong
tokenizer), and route receipts in a header and in /route."""

from __future__ import annotations

import json
import logging


from serve_app.prediction import PredictionCheck, PredictionCheckConfig
from serve_app.usage import UsageStrip, body_usage, stream_usage, with_stream_usage
from tests.serve_app.test_lora import Fleet, _sim, chat

CHUNK = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"\\"usage\\":{"}}],"usage":null}\n\n'
USAGE = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":100,'
         b'"completion_tokens":2,"total_tokens":102,"prompt_tokens_details":{"cached_tokens":64}}}\n\n')
DONE = b"data: [DONE]\n\n"


def test_usage_is_read_from_a_json_body_without_being_fooled_by_content():
    body = json.dumps({"choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 1}'}}],
                      "usage": {"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 480}},
                      "metadata": {}}).encode()
    assert body_usage(body, "/v1/chat/completions") == (500, 480)
    assert body_usage(b'{"text":"x","meta_info":{"prompt_tokens":9,"cached_tokens":8}}', "/generate") == (9, 8)
    assert body_usage(b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}', "/v1/completions") is None
    assert body_usage(b'{"object":"error","message":"no"}', "/v1/completions") is None


def test_a_streams_usage_is_its_final_chunks_and_stripping_removes_exactly_that_event():
    assert stream_usage(CHUNK + USAGE + DONE, "/v1/chat/completions") == (100, 64)
    strip = UsageStrip()
    out = strip.piece(CHUNK) + strip.piece(CHUNK + USAGE) + strip.piece(DONE) + strip.flush()
    assert out == CHUNK + CHUNK + DONE and strip.usage == (100, 64)
    split = UsageStrip()  # the usage event split across two pieces: held back, then removed
    out = split.piece(CHUNK + USAGE[:60]) + split.piece(USAGE[60:] + DONE) + split.flush()
    assert out == CHUNK + DONE and split.usage == (100, 64)


def test_usage_is_asked_for_upstream_by_splicing_the_raw_body_or_merging_stream_options():
    raw = b'{"model":"m","stream":true,"messages":[]}'
    sent, obj = with_stream_usage(raw, json.loads(raw))
    assert json.loads(sent) == {**json.loads(raw), "stream_options": {"include_usage": True}} == obj
    raw = b'{"stream":true,"stream_options":{"continuous_usage_stats":false},"messages":[]}'
    sent, _ = with_stream_usage(raw, json.loads(raw))
    assert json.loads(sent)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_the_check_warns_once_per_interval_naming_the_worker_and_the_cause():
    check = PredictionCheck(PredictionCheckConfig(window=8, min_tokens=1000, ratio=0.5, warn_interval_s=60))
    warnings = [check.observe("w0", 900, 0, 1000, float(t)) for t in range(8)]
    assert warnings[0] is None  # 900 tokens: below min_tokens, not judged yet
    assert warnings[1] is not None and "worker w0" in warnings[1] and "--page-size" in warnings[1]
    assert warnings[2:] == [None] * 6  # once per interval
    assert check.view("w0")["verdict"] == "overpredicted" and check.view("w0")["predicted_hit_rate"] == 0.9
    assert check.observe("w0", 900, 0, 1000, 61.0) is not None
    blind = [check.observe("w1", 0, 800, 1000, 0.0) for _ in range(3)]
    assert blind[1] is not None and "tokenizer" in blind[1] and check.view("w1")["verdict"] == "blind"
    for t in range(8):
        assert check.observe("w2", 500, 480, 1000, float(t)) is None
    assert check.view("w2")["verdict"] == "ok"


async def test_prediction_counters_and_workers_view_track_the_engines_cached_tokens():
    async with Fleet({"w0": _sim(), "w1": _sim()}) as f:
        for i in range(6):
            assert (await f.post("/v1/chat/completions", chat(user=f"q{i}")))[0] == 200
        view = {w["name"]: w["prefix_cache_check"] for w in f.core.workers_json()["workers"]}
        seen = [v for v in view.values() if v is not None]
        assert sum(v["requests"] for v in seen) == 6
        assert sum(v["cached_tokens"] for v in seen) > 500  # the shared system prompt, reported by the engines
        text = f.metrics.render().decode()
        cached = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("kvroute_prompt_tokens_cached_total{"))
        predicted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("kvroute_prompt_tokens_predicted_cached_total{"))
        assert cached == sum(v["cached_tokens"] for v in seen) and predicted > 0
        assert "kvroute_prompt_cache_prediction_error_bucket" in text
        assert all(v["verdict"] == "ok" for v in seen)


async def test_a_stream_is_relayed_exactly_as_the_client_asked_while_its_usage_is_read():
    async with Fleet({"w0": _sim()}) as f:
        status, _, body = await f.post("/v1/chat/completions", chat(user="a", stream=True))
        assert status == 200 and body.endswith(DONE)
        assert b'"usage":{' not in body and b'"choices":[]' not in body  # the chunk the router asked for
        status, _, body = await f.post("/v1/chat/completions",
                                       chat(user="b", stream=True, stream_options={"include_usage": True}))
        assert b'"choices":[],"usage":{' in body  # asked for by the client: relayed
        status, _, body = await f.post("/v1/completions", {"prompt": "x" * 400, "max_tokens": 2, "stream": True})
        assert status == 200 and b'"usage":{' not in body
        assert f.core.workers_json()["workers"][0]["prefix_cache_check"]["requests"] == 3


async def test_a_page_size_the_router_does_not_know_is_reported_as_predicted_hits_that_never_happen(caplog):
    """Deliberately wrong: the engine caches 256-token pages, the router counts 16-token blocks — a
    shared prefix shorter than a page is never a hit, whatever the router predicts."""
    prefix = "Shared instructions for every ticket of the day. " * 16  # ~200 tokens: under one page
    async with Fleet({"w0": _sim(engine={"page_size": 256})}, block_size=16,
                     prediction_check={"window": 8, "min_tokens": 500}) as f:
        with caplog.at_level(logging.WARNING, logger="kvroute.router"):
            for i in range(10):
                body = {"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": f"t{i}"}],
                        "max_tokens": 1}
                assert (await f.post("/v1/chat/completions", body))[0] == 200
        check = f.core.workers_json()["workers"][0]["prefix_cache_check"]
        assert check["cached_tokens"] == 0 and check["predicted_cached_tokens"] > 500
        assert check["verdict"] == "overpredicted"
        warned = [r.getMessage() for r in caplog.records if "predicted prefix hits are not happening" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith("worker w0:")


async def test_a_tokenizer_unlike_the_engines_is_reported_as_blind_affinity(caplog):
    """Deliberately wrong tokenizer: the router hashes each prompt as different tokens (a prompt
    nobody sent before, every time), while the engine keeps hitting its cached system prompt."""
    async with Fleet({"w0": _sim()}, prediction_check={"window": 8, "min_tokens": 500}) as f:
        f.core.facts = lambda body, real=f.core.facts: real({**body, "messages": [  # type: ignore[method-assign]
            {"role": "user", "content": json.dumps(body["messages"])[::-1] + str(id(body))}]})
        with caplog.at_level(logging.WARNING, logger="kvroute.router"):
            for i in range(10):
                assert (await f.post("/v1/chat/completions", chat(user=f"q{i}")))[0] == 200
        assert f.core.workers_json()["workers"][0]["prefix_cache_check"]["verdict"] == "blind"
        assert any("prefix affinity is blind" in r.getMessage() and "tokenizer" in r.getMessage()
                   for r in caplog.records)


# --- route receipts ---------------------------------------------------------------------------


async def test_x_kvroute_explain_returns_every_candidates_cost_terms_overlap_and_input_ages():
    async with Fleet({"w0": _sim(), "w1": _sim(), "w2": _sim()}) as f:
        assert (await f.post("/v1/chat/completions", chat(user="warm")))[0] == 200
        status, hdrs, _ = await f.post("/v1/chat/completions", chat(user="next"), {"x-kvroute-explain": "1"})
        assert status == 200
        receipt = json.loads(hdrs["x-kvroute-route"])
        assert receipt["worker"] == hdrs["x-kvroute-worker"] and receipt["policy"] == "kv_aware"
        cands = {c["target"]: c for c in receipt["candidates"]}
        assert set(cands) == {"w0", "w1", "w2"}
        chosen = cands[receipt["worker"]]
        assert chosen["overlap_blocks"] >= 8 and chosen["overlap_source"] == "approximate"
        assert all(c["cost"] is not None and set(c["terms"]) >= {"base", "per_new_block"} for c in cands.values())
        assert all(set(c["ages_s"]) == {"metrics", "kv_events", "in_flight_share"} for c in cands.values())
        assert all(c["ages_s"]["metrics"] is not None for c in cands.values())
        status, hdrs, _ = await f.post("/v1/chat/completions", chat(user="plain"))
        assert "x-kvroute-route" not in hdrs  # not asked: not computed


def test_a_receipt_is_computed_only_when_asked():
    from tests.serve_app.test_lora import make_core
    core, _ = make_core({"w0": (["M"], []), "w1": (["M"], [])})
    calls = []
    real = core._receipt
    core._receipt = lambda *a: calls.append(1) or real(*a)  # type: ignore[method-assign]
    t = core.route(core.facts(chat(user="x")), model="M")
    assert t.receipt is None and not calls
    t = core.route(core.facts(chat(user="x")), model="M", explain=True)
    assert calls and {c["target"] for c in t.receipt["candidates"]} == {"w0", "w1"}
