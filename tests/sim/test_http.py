"""`python -m sim` as a real process: SGLang's HTTP surface, its sockets, and a clean SIGTERM exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import zmq

from actors.wire import decode_kv_metrics
from sim.kv_events import BlockStored, block_hashes, decode_batch
from sim.tokenizer import apply_chat_template

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    """Nobody listens and a new server could bind it (SO_REUSEADDR, as uvicorn binds: closed
    connections may leave TIME_WAIT entries on the port, which do not block a new listener)."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """One sim process (10× faster than real time) with a bound PULL and a bound SUB: like SGLang
    0.5.23, the sim's PUB connects to a concrete tcp:// endpoint, so the subscriber binds it."""
    tmp = tmp_path_factory.mktemp("sim")
    ctx = zmq.Context()
    metrics_ep = f"ipc://{tmp}/metrics-{uuid.uuid4().hex[:6]}"
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(metrics_ep)
    port = _free_port()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    kv_port = sub.bind_to_random_port("tcp://127.0.0.1")
    argv = [
        sys.executable, "-m", "sim", "--port", str(port), "--metrics-endpoint", metrics_ep,
        "--wire", "0.5.23", "--time-scale", "0.1", "--page-size", "16", "--decode-log-interval", "5",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}", "--kv-events-encoding", "map",
        "--model-name", "sim-model",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "sim never became healthy"
        time.sleep(0.05)
    # a connecting PUB drops what it sends before the subscription reached it (as SGLang's does):
    # warm up until one batch arrives, then start from an empty socket
    for i in range(50):
        httpx.post(url + "/generate", json={"input_ids": list(range(90_000 + 32 * i, 90_000 + 32 * i + 16)),
                                            "sampling_params": {"max_new_tokens": 1}}, timeout=5)
        if sub.poll(200):
            break
    while sub.poll(300):
        sub.recv_multipart()
    while pull.poll(300):
        pull.recv()
    client = httpx.Client(base_url=url, timeout=10)
    yield {"proc": proc, "client": client, "pull": pull, "sub": sub, "port": port}
    client.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    ctx.destroy(linger=0)


def _sse(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_non_stream_chat_reports_usage_and_cached_tokens(sim):
    c = sim["client"]
    body = {"model": "sim-model", "messages": [{"role": "system", "content": "word " * 64},
                                               {"role": "user", "content": "hi"}], "max_tokens": 7}
    first = c.post("/v1/chat/completions", json=body).json()
    second = c.post("/v1/chat/completions", json=body).json()
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 7
    n_prompt = len(apply_chat_template(body["messages"]))
    assert first["usage"]["prompt_tokens"] == n_prompt
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == ((n_prompt - 1) // 16) * 16
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_stream_chat_sends_deltas_usage_then_done(sim):
    body = {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with sim["client"].stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = _sse(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [ch["choices"][0]["delta"].get("content") for ch in chunks if ch["choices"]]
    assert len([t for t in contents if t]) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_completions_stream_and_non_stream(sim):
    c = sim["client"]
    plain = c.post("/v1/completions", json={"prompt": "once upon a time", "max_tokens": 4}).json()
    assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] == 4
    with c.stream("POST", "/v1/completions", json={"prompt": "once upon a time", "max_tokens": 4,
                                                    "stream": True}) as r:
        data = _sse(r)
    assert data[-1] == "[DONE]"
    texts = [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
    assert "".join(texts) == plain["choices"][0]["text"]


def test_shapes_held_to_the_real_0_5_23_server(sim):
    """As SGLang 0.5.23's own server answers (tests/real_engine/test_sim_parity.py compares the two):
    a streamed completion's last token chunk carries finish_reason (no empty chunk after it) and its
    usage chunk has no completion_tokens_details, non-streamed usage has it (null), a body failing
    validation gets "param": null, /v1/loads carries the disaggregation section."""
    c = sim["client"]
    with c.stream("POST", "/v1/completions", json={"prompt": "once upon a time", "max_tokens": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}}) as r:
        data = [json.loads(d) for d in _sse(r)[:-1]]
    chunks = [d for d in data if d["choices"]]
    assert len(chunks) == 3 and all(ch["choices"][0]["text"] for ch in chunks)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, "length"]
    assert "completion_tokens_details" not in data[-1]["usage"] and data[-1]["usage"]["completion_tokens"] == 3
    plain = c.post("/v1/completions", json={"prompt": "once", "max_tokens": 2}).json()
    assert "completion_tokens_details" in plain["usage"] and plain["usage"]["completion_tokens_details"] is None
    bad = c.post("/v1/chat/completions", json={"messages": "not a list"})
    assert bad.status_code == 400 and bad.json()["param"] is None and bad.json()["type"] == "BadRequestError"
    assert c.get("/v1/loads").json()["loads"][0]["disaggregation"]["mode"] == "null"


def test_generate_native_stream_is_cumulative(sim):
    c = sim["client"]
    body = {"text": "native api", "sampling_params": {"max_new_tokens": 3}}
    plain = c.post("/generate", json=body).json()
    assert plain["meta_info"]["completion_tokens"] == 3 and len(plain["output_ids"]) == 3
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        data = _sse(r)
    assert data[-1] == "[DONE]"
    texts = [json.loads(d)["text"] for d in data[:-1]]
    assert texts[-1] == plain["text"] and all(texts[-1].startswith(t) for t in texts)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{broken"),
        ("/v1/chat/completions", b'{"messages": "not a list"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}'),
        ("/v1/completions", b'{"prompt": 17}'),
        ("/generate", b'{"sampling_params": {"max_new_tokens": 2}}'),
    ],
)
def test_malformed_bodies_get_400_with_a_json_error(sim, path, body):
    r = sim["client"].post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    payload = r.json()
    message = payload.get("message") or payload["error"]["message"]
    assert message
    assert sim["client"].get("/health").status_code == 200


def test_probes_and_info_routes(sim):
    c = sim["client"]
    assert c.get("/health_generate").status_code == 200
    assert c.get("/v1/models").json()["data"][0]["id"] == "sim-model"
    for path in ("/model_info", "/get_model_info"):
        assert c.get(path).json()["model_path"] == "sim-model"
    for path in ("/server_info", "/get_server_info"):
        info = c.get(path).json()
        assert info["page_size"] == 16 and info["max_total_num_tokens"] == 400_000
        assert info["max_running_requests"] == 1024
        assert info["kv_events"]["block_size"] == 16
    stats = c.get("/sim/stats").json()
    assert stats["requests_finished_total"] >= 1 and 0.0 <= stats["cumulative_cache_hit_rate"] <= 1.0


def test_load_routes_have_sglangs_shapes(sim):
    c = sim["client"]
    # this sim claims 0.5.23, which has no /get_load (only /v1/loads): FastAPI's 404, as from SGLang
    legacy = c.get("/get_load")
    assert (legacy.status_code, legacy.json()) == (404, {"detail": "Not Found"})
    loads = c.get("/v1/loads", params={"include": "core"}).json()
    core = loads["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "num_total_tokens", "token_usage", "max_total_num_tokens"} <= set(core)
    assert "memory" not in core
    assert c.get("/v1/loads", params={"include": "bogus"}).status_code == 400


def test_metrics_use_sglang_names(sim):
    text = sim["client"].get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert 'model_name="sim-model"' in text


def test_kv_metrics_and_kv_events_arrive_on_the_sockets(sim):
    ids = list(range(2000, 2040))  # 2 full pages of 16
    sim["client"].post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    pull, sub = sim["pull"], sim["sub"]
    assert pull.poll(3000)
    reports = []
    while pull.poll(200):
        reports.append(decode_kv_metrics(pull.recv()))
    assert reports and all(r.kv_total_blocks == 400_000 for r in reports)
    stored: list[int] = []
    while sub.poll(500):
        _topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8
        stored += [h for e in decode_batch(payload)[1] if isinstance(e, BlockStored) for h in e.block_hashes]
    assert set(block_hashes(ids, 16)) <= set(stored)


def test_sigterm_exits_quickly_quietly_and_frees_the_port(sim):
    proc, port = sim["proc"], sim["port"]
    # an open stream must not hold the shutdown back
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "long"}], "max_tokens": 5000,
                            "stream": True}) as r:
        next(r.iter_lines())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert proc.returncode == 0
    out, err = proc.communicate()
    assert out == b"" and b"Traceback" not in err
    assert _port_is_free(port)
