"""Two real SGLang 0.5.23 engines (CPU, tiny model) behind `kvroute serve` in attach mode with exact
prefix mode: the OpenAI SDK's routes, /workers against the engines' own Prometheus /metrics, and
the real radix cache's KV events driving kvroute's index (repeat → cache holder, eviction, flush)."""

from __future__ import annotations

import math
import random
import re
import threading
import time

import pytest

pytest.importorskip("sglang", reason="the real-engine lane runs in scripts/sglang_env.sh 0.5.23's venv")

import httpx  # noqa: E402
from openai import OpenAI  # noqa: E402

from tests.real_engine.engines import MAX_RUNNING, MAX_TOTAL_TOKENS, PAGE_SIZE  # noqa: E402
from tests.real_engine.fleet import MODEL_NAME, bring_up, overlap, shut_down, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def fleet(workdir, model_dir):
    tmp = workdir("serve")
    engines, serve, startup = bring_up(tmp, model_dir)
    print(f"startup (s): {startup}")
    client = OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield {"engines": {e.name: e for e in engines}, "serve": serve, "client": client, "startup": startup}
    shut_down(engines, serve)


def _words(rng: random.Random, n: int) -> str:
    from tests.real_engine.tiny_model import _WORDS

    return " ".join(rng.choice(_WORDS) for _ in range(n))


def test_openai_sdk_routes_through_kvroute(fleet):
    c = fleet["client"]
    seen = set()
    for i in range(4):  # kv_aware takes turns on cold prompts: both workers serve
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"hello {i} river"}], max_tokens=8, temperature=0)
        r = raw.parse()
        seen.add(raw.headers["x-kvroute-worker"])
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert seen == {"w1", "w2"}

    stream = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "stream please"}],
                                       max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12

    comp = c.completions.create(model=MODEL_NAME, prompt="the cache router", max_tokens=6, temperature=0)
    assert comp.object == "text_completion" and comp.choices[0].text and comp.usage.completion_tokens == 6
    streamed = list(c.completions.create(model=MODEL_NAME, prompt="the cache router", max_tokens=6, temperature=0,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == comp.choices[0].text  # greedy: same text

    g = httpx.post(f"{fleet['serve'].url}/generate", timeout=60,
                   json={"text": "the cache router", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert g.status_code == 200 and g.headers["x-kvroute-worker"] in ("w1", "w2")
    assert g.json()["meta_info"]["completion_tokens"] == 6 and g.json()["text"] == comp.choices[0].text

    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


_PROM = re.compile(r"^sglang:(num_running_reqs|num_queue_reqs|token_usage)\{[^}]*\} (\S+)$", re.M)
# the scheduler's log line at each log point ("Prefill batch, … token usage: 0.25, #running-req: 8,
# #queue-req: 3, …" / "Decode batch, #running-req: 8, #token: …, token usage: 0.25, … #queue-req: 3")
_LOG = re.compile(r"(Prefill|Decode) batch.*?(?=.*#running-req: (\d+))(?=.*token usage: ([\d.]+))(?=.*#queue-req: (\d+))")


def _scrape(url: str) -> tuple[int, int, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    vals = {m.group(1): float(m.group(2)) for m in _PROM.finditer(text)}
    return int(vals["num_running_reqs"]), int(vals["num_queue_reqs"]), vals["token_usage"]


def _log_points(engine, offset: int) -> list[tuple[int, int, float]]:
    text = engine.log_path.read_text(errors="replace")[offset:]
    return [(int(m.group(2)), int(m.group(4)), float(m.group(3))) for m in _LOG.finditer(text)]


def test_workers_live_with_kv_metrics_that_agree_with_the_engines_prometheus_and_log(fleet):
    """SGLang writes its scheduler log line, sets its Prometheus gauges and sends KvMetrics from one
    stats object at one log point (metrics_reporter: `log_stats(stats)` then `emit_kv_metrics()`),
    so under load every KvMetrics value kvroute's /workers shows is exactly one of the engine's log
    points, and so is every scrape of its /metrics: request_active_slots = sglang:num_running_reqs
    = "#running-req", num_requests_waiting = sglang:num_queue_reqs = "#queue-req",
    gpu_cache_usage_perc = sglang:token_usage = "token usage" (SGLang rounds it to 2 decimals),
    kv_active_blocks = ceil(int(token_usage × max_total_num_tokens) / page_size) (the token count
    SGLang sends, in kvroute's pages), kv_total_blocks = max_total_num_tokens / page_size,
    request_total_slots = max_running_requests. Load: more long streams on w1 than it has slots
    (some queue), a few on w2, sent to the engines directly so kvroute only observes."""
    engines, serve = fleet["engines"], fleet["serve"]
    offsets = {n: len(e.log_path.read_text(errors="replace")) for n, e in engines.items()}
    scrapes: dict[str, list[tuple[int, int, float]]] = {n: [] for n in engines}
    stop = threading.Event()

    def scraper(name):
        while not stop.is_set():
            try:
                scrapes[name].append(_scrape(engines[name].url))
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def stream(url, n_tokens, seed):
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as hc:
            hc.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": _words(rng, 60), "max_tokens": n_tokens,
                                                    "temperature": 0, "ignore_eos": True}).raise_for_status()

    load = [threading.Thread(target=stream, args=(engines["w1"].url, 600, i)) for i in range(MAX_RUNNING + 3)]
    load += [threading.Thread(target=stream, args=(engines["w2"].url, 400, 100 + i)) for i in range(3)]
    scrapers = [threading.Thread(target=scraper, args=(n,), daemon=True) for n in engines]
    shown: dict[str, list[tuple]] = {n: [] for n in engines}
    ages: dict[str, list[tuple[float, float]]] = {n: [] for n in engines}  # (heartbeat_age_s, metrics_age_s), reported
    for t in scrapers + load:
        t.start()
    try:
        t_end = time.monotonic() + 40
        while any(t.is_alive() for t in load) and time.monotonic() < t_end:
            for name, w in serve.workers().items():
                m = w["metrics"]
                # idle until the load reaches it (SGLang is silent when idle: no probe keeps it live now)
                assert w["state"] in ("live", "idle"), w
                if m is None:
                    continue
                assert m["kv_total_blocks"] == MAX_TOTAL_TOKENS // PAGE_SIZE and m["request_total_slots"] == MAX_RUNNING
                shown[name].append((m["request_active_slots"], m["num_requests_waiting"], m["gpu_cache_usage_perc"],
                                    m["kv_active_blocks"]))
                ages[name].append((w["heartbeat_age_s"], w["metrics_age_s"]))
            time.sleep(0.2)
    finally:
        for t in load:
            t.join(timeout=120)
        stop.set()
    for name, e in engines.items():
        assert len(set(_log_points(e, offsets[name]))) >= 5  # the load made log points
        # the first values shown may be a report from before the load (e.g. a /health confirmation's
        # one-token batch): every value is still exactly one of the engine's log points
        points = set(_log_points(e, 0))
        for r, q, u, blocks in shown[name]:
            assert (r, q, u) in points, (name, (r, q, u), sorted(points))
            assert blocks == math.ceil(int(u * MAX_TOTAL_TOKENS) / PAGE_SIZE), (name, u, blocks)
        load_scrapes = [s for s in scrapes[name] if s != (0, 0, 0.0)]  # before the load reached it
        assert load_scrapes and all(s in points for s in load_scrapes), (name, [s for s in load_scrapes if s not in points])
    for name, a in ages.items():
        print(f"{name} under load: heartbeat_age_s max {max(x for x, _ in a):.2f}, metrics_age_s max {max(y for _, y in a):.2f}")
    w1, w2 = shown["w1"], shown["w2"]
    assert any(r == MAX_RUNNING and q >= 1 for r, q, _, _ in w1), w1  # w1 full with requests queued
    assert any(r >= 2 and q == 0 and u > 0 for r, q, u, _ in w2), w2
    assert any(u >= 0.1 and blocks > 50 for _, _, u, blocks in w1), w1
    assert len(set(w1)) >= 4  # it followed the load, not one frame


def _completion(c, prompt, **kw):
    raw = c.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=kw.pop("max_tokens", 4),
                                                 temperature=0, **kw)
    r = raw.parse()
    return raw.headers["x-kvroute-worker"], r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_a_repeated_prompt_goes_to_the_worker_whose_real_cache_holds_it(fleet):
    serve, c = fleet["serve"], fleet["client"]
    rng = random.Random(31)
    for turn in range(3):
        prompt = _words(rng, 300)  # ~350 tokens: ~21 pages
        first, n_prompt, cached0 = _completion(c, prompt)
        assert cached0 == 0
        # the engine's BlockStored batch reaches kvroute's index: /route sees the whole prompt there
        full = (n_prompt - 1) // PAGE_SIZE
        d = wait_for(lambda: (x := serve.route({"model": MODEL_NAME, "prompt": prompt}))["worker"] == first
                     and overlap(x) >= full and x, 10, what=f"index holds the prompt on {first}")
        again, _, cached = _completion(c, prompt)
        assert again == first
        assert cached > 0 and cached == overlap(d) * PAGE_SIZE  # kvroute's index and the engine's cache agree to the page

    # a conversation: the next turn's prompt extends the last one's (chat template tokenized by kvroute as SGLang does)
    msgs = [{"role": "user", "content": _words(rng, 200)}]
    raw = c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0)
    worker, reply = raw.headers["x-kvroute-worker"], raw.parse()
    msgs += [{"role": "assistant", "content": reply.choices[0].message.content},
             {"role": "user", "content": _words(rng, 20)}]
    d = wait_for(lambda: (x := serve.route({"model": MODEL_NAME, "messages": msgs}))["worker"] == worker
                 and overlap(x) >= (reply.usage.prompt_tokens - 1) // PAGE_SIZE and x, 10, what="conversation indexed")
    raw2 = c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=msgs, max_tokens=4, temperature=0)
    assert raw2.headers["x-kvroute-worker"] == worker
    cached = raw2.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= (reply.usage.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE and cached == overlap(d) * PAGE_SIZE


def test_a_full_pool_evicts_and_the_index_drops_what_block_removed_says(fleet):
    """Prompt A is cached on one worker, then that engine's pool (8,192 tokens) is flooded directly
    with other prompts: its radix cache evicts A (LRU) and publishes BlockRemoved, and kvroute's
    index no longer places A anywhere; the engine itself confirms (cached_tokens 0 for A)."""
    serve, c, engines = fleet["serve"], fleet["client"], fleet["engines"]
    rng = random.Random(7)
    prompt = _words(rng, 400)
    worker, n_prompt, _ = _completion(c, prompt)
    wait_for(lambda: overlap(serve.route({"model": MODEL_NAME, "prompt": prompt})) >= (n_prompt - 1) // PAGE_SIZE,
             10, what="A indexed")
    batches_before = serve.workers()[worker]["managed"]["kv_events"]["batches"]
    with httpx.Client(timeout=120) as hc:
        for i in range((MAX_TOTAL_TOKENS // 1500) + 2):  # > the pool in distinct 1,500-token prompts
            r = hc.post(f"{engines[worker].url}/v1/completions",
                        json={"model": MODEL_NAME, "prompt": [rng.randrange(10, 1000) for _ in range(1500)],
                              "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
    wait_for(lambda: overlap(serve.route({"model": MODEL_NAME, "prompt": prompt})) == 0, 10,
             what="A dropped from the index")
    w = serve.workers()[worker]
    assert w["managed"]["kv_events"]["batches"] > batches_before and w["managed"]["kv_events"]["status"] == "ok"
    with httpx.Client(timeout=60) as hc:
        r = hc.post(f"{engines[worker].url}/v1/completions",
                    json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the engine evicted it too


def test_flush_cache_clears_the_index(fleet):
    serve, c, engines = fleet["serve"], fleet["client"], fleet["engines"]
    rng = random.Random(11)
    prompts = {}
    for _ in range(4):  # cached on both workers: placed round-robin (this test is about the index, not the policy)
        p = _words(rng, 200)
        w, n, _ = _completion(c, p, extra_headers={"x-kvroute-policy": "round_robin"})
        prompts[p] = (w, n)
    assert {w for w, _ in prompts.values()} == {"w1", "w2"}
    for p, (w, n) in prompts.items():
        wait_for(lambda: (x := serve.route({"model": MODEL_NAME, "prompt": p}))["worker"] == w and overlap(x) > 0,
                 10, what="indexed")
    for e in engines.values():
        r = httpx.post(f"{e.url}/flush_cache", timeout=30)
        assert r.status_code == 200, r.text
    for p in prompts:
        wait_for(lambda: overlap(serve.route({"model": MODEL_NAME, "prompt": p})) == 0, 10, what="index cleared")
    w, _, cached = _completion(c, next(iter(prompts)))
    assert cached == 0
