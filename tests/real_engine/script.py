"""One scripted sequence of requests (58 of them) sent to one engine — the real SGLang server or the
simulator — while an `Observer` listens to its KvMetrics and KV events. `run(url, observer)`
returns a `Transcript` of what a router depends on, in a form two engines can be compared by:
token-id prompts (so both engines see the same tokens whatever their tokenizers), temperature 0."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sim.kv_events import BlockRemoved, BlockStored, block_hashes
from tests.real_engine.observe import Observer

PAGE = 16
MODEL = "tiny"


@dataclass
class Transcript:
    requests: int = 0
    http: dict[str, Any] = field(default_factory=dict)  # name → (status, shape)
    usage: dict[str, Any] = field(default_factory=dict)  # name → usage facts
    metrics: dict[str, Any] = field(default_factory=dict)  # phase → KvMetrics facts
    kv: dict[str, Any] = field(default_factory=dict)  # phase → KV-event facts
    raw: dict[str, Any] = field(default_factory=dict)  # for messages on failure


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def shape(obj: Any) -> Any:
    """The JSON's structure: keys (recursively) and value types, not values."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    return type(obj).__name__


def _stored_pages(frames) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent, page tokens) of every page the BlockStored events in `frames` announce."""
    out = []
    for f in frames:
        for ev in f.body[1]:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    out.append((h, parent, list(ev.token_ids[i * PAGE:(i + 1) * PAGE])))
                    parent = h
    return out


def _removed(frames) -> list[int]:
    return [h for f in frames for ev in f.body[1] if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


def _event_kinds(frames) -> list[str]:
    return [type(ev).__name__ for f in frames for ev in f.body[1]]


def _metric_facts(frames) -> dict[str, Any]:
    ms = [f.body for f in frames]
    return {
        "count": len(ms),
        "usage_2_decimals": all(round(m.gpu_cache_usage_perc, 2) == m.gpu_cache_usage_perc for m in ms),
        "active_is_int_usage": all(m.kv_active_blocks == int(m.gpu_cache_usage_perc * m.kv_total_blocks) for m in ms),
        "totals": sorted({(m.request_total_slots, m.kv_total_blocks, m.data_parallel_rank) for m in ms}),
    }


class Client:
    def __init__(self, url: str, t: Transcript) -> None:
        self.url = url
        self.t = t
        self.hc = httpx.Client(base_url=url, timeout=120)

    def post(self, path: str, body: Any, **kw) -> httpx.Response:
        self.t.requests += 1
        return self.hc.post(path, json=body, **kw)

    def get(self, path: str) -> httpx.Response:
        self.t.requests += 1
        return self.hc.get(path)

    def complete(self, prompt, max_tokens=8, **extra) -> dict[str, Any]:
        r = self.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True, **extra})
        r.raise_for_status()
        return r.json()


def _sse(r: httpx.Response) -> list[Any]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run(url: str, ob: Observer) -> Transcript:
    t = Transcript()
    c = Client(url, t)
    rng = random.Random(2026)

    # a clean start: whatever the engine held (its warm-up request) is flushed
    r = c.post("/flush_cache", None)
    t.http["flush_cache"] = (r.status_code, r.text)
    time.sleep(1.0)

    # silence when idle
    m = ob.mark()
    time.sleep(2.0)
    t.metrics["idle"] = len(ob.since(m))

    # the routes a router reads
    m = ob.mark()
    t0 = time.monotonic()
    r = c.get("/health")
    t.http["health"] = (r.status_code, r.text)
    t.raw["health_s"] = time.monotonic() - t0
    time.sleep(1.0)
    t.metrics["after_health"] = len(ob.since(m, "metrics"))
    r = c.get("/v1/models")
    t.http["models"] = (r.status_code, shape(r.json()), [d["id"] for d in r.json()["data"]])
    r = c.get("/server_info")
    si = r.json()
    t.http["server_info"] = (r.status_code, {k: si.get(k) for k in ("page_size", "max_total_num_tokens",
                                                                       "max_running_requests", "served_model_name")},
                             {k: (si.get("kv_events") or {}).get(k) for k in ("publisher", "endpoint_host",
                                                                              "topic", "block_size", "dp_size")},
                             (si.get("kv_events") or {}).get("endpoint_port_base") == int(ob.kv_endpoint.rsplit(":", 1)[1]))
    r = c.get("/v1/loads")
    loads = r.json()
    t.http["loads"] = (r.status_code, sorted(loads), sorted(loads["loads"][0]))

    # shared prefixes: one 64-token system prefix, six suffixes (token ids)
    prefix = ids(rng, 4 * PAGE)
    m = ob.mark()
    prompts = []
    for i in range(6):
        p = prefix + ids(rng, 40 + i)
        prompts.append(p)
        u = c.complete(p, max_tokens=8)["usage"]
        t.usage[f"shared{i}"] = (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])
    time.sleep(0.5)
    frames = ob.since(m)
    pages = _stored_pages(f for f in frames if f.kind == "kv")
    expect = set(block_hashes(prefix, PAGE))
    for p in prompts:
        expect |= set(block_hashes(p, PAGE))
    t.kv["shared_prompt_pages_stored"] = expect <= {h for h, _, _ in pages}  # SGLang's hash of the prompt pages
    t.kv["shared_stored_once"] = len({h for h, _, _ in pages}) == len(pages)
    t.kv["shared_kinds"] = sorted(set(_event_kinds(f for f in frames if f.kind == "kv")))
    known = {h: tok for h, _, tok in pages}
    t.kv["chained"] = all(par is None or par in known or par in expect for _, par, _ in pages)
    t.kv["page_tokens"] = all(len(tok) == PAGE for _, _, tok in pages)
    t.metrics["shared"] = _metric_facts(f for f in frames if f.kind == "metrics")
    hits = [round(f.body.gpu_prefix_cache_hit_rate, 4) for f in frames if f.kind == "metrics"]
    t.metrics["shared_hit_rates"] = sorted(set(hits))

    # exact repeats, a prompt whose length is a multiple of the page
    for name, n in (("len96", 6 * PAGE), ("len97", 6 * PAGE + 1), ("len95", 6 * PAGE - 1)):
        p = ids(rng, n)
        a = c.complete(p, max_tokens=4)["usage"]
        b = c.complete(p, max_tokens=4)["usage"]
        t.usage[name] = (a["prompt_tokens_details"]["cached_tokens"], b["prompt_tokens_details"]["cached_tokens"])
    # a repeat with a long output: does the decode report keep the prefill's hit rate?
    p = ids(rng, 100)
    c.complete(p, max_tokens=4)
    m = ob.mark()
    c.complete(p, max_tokens=100)
    time.sleep(0.3)
    ms = [f.body for f in ob.since(m, "metrics")]
    t.metrics["repeat_long"] = {"prefill_hit": round(ms[0].gpu_prefix_cache_hit_rate, 2) if ms else None,
                                "decode_hits": sorted({round(x.gpu_prefix_cache_hit_rate, 2) for x in ms[1:]})}

    # multi-turn chat (text: the engines' tokenizers differ, so only the structure is compared)
    msgs = [{"role": "system", "content": "You are a cache. " * 10}]
    chat_usage = []
    for turn in range(4):
        msgs.append({"role": "user", "content": f"turn {turn}: " + "the river and the bridge " * 6})
        r = c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0})
        body = r.json()
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        chat_usage.append(body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0)
        if turn == 0:
            t.http["chat"] = (r.status_code, sorted(body), sorted(body["usage"]), sorted(body["choices"][0]))
    t.usage["chat_cached_after_first"] = chat_usage

    # concurrency: more requests than slots
    m = ob.mark()
    errs = []

    def one(seed):
        try:
            c2 = httpx.Client(base_url=url, timeout=120)
            r = c2.post("/v1/completions", json={"model": MODEL, "prompt": ids(random.Random(seed), 50), "max_tokens": 120,
                                                 "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
        except Exception as exc:
            errs.append(repr(exc))

    threads = [threading.Thread(target=one, args=(1000 + i,)) for i in range(11)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.requests += len(threads)
    time.sleep(0.3)
    ms = [f.body for f in ob.since(m, "metrics")]
    t.metrics["concurrent"] = {"errors": errs, "max_active": max(x.request_active_slots for x in ms),
                               "some_waiting": any(x.num_requests_waiting > 0 for x in ms),
                               "active_8_waiting_3": any(x.request_active_slots == 8 and x.num_requests_waiting == 3 for x in ms)}

    # a decode interval: one request alone, 200 tokens → one prefill report, then one per 40 decode steps
    m = ob.mark()
    c.complete(ids(rng, 30), max_tokens=200)
    time.sleep(0.3)
    ms = [f.body for f in ob.since(m, "metrics")]
    # one per 40 decode steps of the engine's *lifetime* (SGLang's counter does not restart per request):
    # the phase set by earlier traffic makes it 5 or 6 for 200 tokens — what the router relies on is the cadence
    t.metrics["decode_reports"] = 200 // 40 <= len(ms) <= 200 // 40 + 1
    m = ob.mark()
    time.sleep(2.0)
    t.metrics["idle_after_burst"] = len(ob.since(m))

    # streaming
    stream_shapes = []
    for i in range(4):
        with c.hc.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": ids(rng, 20), "max_tokens": 5,
                                                           "temperature": 0, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
            t.requests += 1
            ev = _sse(r)
        stream_shapes.append((r.status_code, r.headers.get("content-type", "").split(";")[0], ev[-1],
                              # a chunk per token at most (the detokenizer may join two under load: timing)
                              0 < len([e for e in ev if e != "[DONE]" and e.get("choices")]) <= 5,
                              [e["choices"][0]["finish_reason"] for e in ev if e != "[DONE]" and e.get("choices")][-1],
                              ev[-2]["usage"]["completion_tokens"] if ev[-2].get("usage") else None))
    for i in range(2):
        with c.hc.stream("POST", "/v1/chat/completions", json={"model": MODEL, "max_tokens": 5, "temperature": 0, "stream": True,
                                                                "messages": [{"role": "user", "content": f"stream {i}"}]}) as r:
            t.requests += 1
            ev = _sse(r)
        stream_shapes.append((r.status_code, ev[-1], ev[0]["choices"][0]["delta"].get("role"),
                              [e["choices"][0]["finish_reason"] for e in ev if e != "[DONE]" and e.get("choices")][-1]))
    t.http["streams"] = stream_shapes

    # /generate, text and token ids
    r = c.post("/generate", {"input_ids": ids(rng, 40), "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    g = r.json()
    t.http["generate_ids"] = (r.status_code, sorted(k for k in ("text", "output_ids", "meta_info") if k in g),
                              {k: g["meta_info"].get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")},
                              g["meta_info"]["finish_reason"])
    r = c.post("/generate", {"text": "the cache", "sampling_params": {"max_new_tokens": 3}})
    t.http["generate_text"] = (r.status_code, r.json()["meta_info"]["completion_tokens"], r.json()["meta_info"]["finish_reason"])

    # evictions: distinct 1,500-token prompts until the pool (8,192 tokens) must evict
    first = ids(rng, 1500)
    m = ob.mark()
    u = c.complete(first, max_tokens=2)["usage"]
    for i in range(6):
        c.complete(ids(rng, 1500), max_tokens=2)
    time.sleep(0.5)
    frames = [f for f in ob.since(m) if f.kind == "kv"]
    removed = _removed(frames)
    first_pages = block_hashes(first, PAGE)
    t.kv["evict_kinds"] = sorted(set(_event_kinds(frames)))
    t.kv["evicted_first_prompt_pages"] = len(set(first_pages) & set(removed))
    t.kv["evicted_only_stored"] = set(removed) <= {h for h, _, _ in _stored_pages(ob.since(0, "kv"))}
    t.raw["removed"] = len(removed)
    u2 = c.complete(first, max_tokens=2)["usage"]
    t.usage["after_evict"] = (u["prompt_tokens_details"]["cached_tokens"], u2["prompt_tokens_details"]["cached_tokens"])

    # flush_cache
    m = ob.mark()
    r = c.post("/flush_cache", None)
    t.http["flush_cache_2"] = (r.status_code, r.text)
    time.sleep(0.5)
    t.kv["flush_kinds"] = _event_kinds(f for f in ob.since(m) if f.kind == "kv")
    t.usage["after_flush"] = c.complete(prompts[0], max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"]

    # a bad body, an over-long prompt, an unknown route, a wrong method
    for name, method, path, body in (
        ("bad_messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": "not a list"}),
        ("no_messages", "POST", "/v1/chat/completions", {"model": MODEL}),
        ("bad_json", "POST", "/v1/completions", None),
        ("too_long", "POST", "/v1/completions", {"model": MODEL, "prompt": [5] * 3000, "max_tokens": 2}),
        ("too_long_generate", "POST", "/generate", {"input_ids": [5] * 3000, "sampling_params": {"max_new_tokens": 2}}),
        ("unknown_route", "GET", "/v1/nope", None),
        ("wrong_method", "GET", "/v1/completions", None),
    ):
        t.requests += 1
        if name == "bad_json":
            r = c.hc.post(path, content=b"{not json", headers={"content-type": "application/json"})
        else:
            r = c.hc.request(method, path, json=body)
        try:
            b = r.json()
        except ValueError:
            b = r.text
        t.http[name] = (r.status_code, shape(b))
        if name.startswith("too_long"):  # the message a client shows: compared word for word
            t.http[name] += (b.get("message") or b.get("error", {}).get("message"),)
        t.raw[name] = b

    # sequence numbers: gap-free over the whole run
    seqs = [f.seq for f in ob.since(0, "kv")]
    t.kv["seq_gap_free"] = seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else None
    t.kv["errors"] = list(ob.errors)
    return t
