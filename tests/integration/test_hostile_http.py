"""Hostile HTTP against the real router through Ray Serve, in front of two simulated SGLang workers.

Specification: every malformed, mistyped, oversized, unauthenticated or otherwise hostile request
gets a clear 4xx whose JSON body names the problem (OpenAI-style `{"error": {...}}` from the
router; SGLang's own error body when the worker is the one that refuses), the router serves a
valid request right afterwards, and the API key never appears in what the router returns.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.fleet import parse_fleet
from serve_app import ray_env
from sim.config import SimConfig
from sim.launch import SimProcess, free_port
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.ray

PREFIX = "/hostile"
API_KEY = "kvr-test-9f2c1e7a5b3d4c6e8a0b"
MAX_BODY = 65_536
AUTH = {"authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
PROXY_ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]
ALL_BODY_ROUTES = ["/route", *PROXY_ROUTES]


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    """Two `python -m sim` workers, their worker actors (attach mode), and the router app with an
    API key and a 64 KiB body limit."""
    import ray
    from ray import serve

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("hostile-http")
    sims = [
        SimProcess(SimConfig(port=free_port(), model_name="m", metrics_endpoint=f"ipc://{tmp}/s{i}.metrics",
                             time_scale=0.02)).start()
        for i in range(2)
    ]
    fleet = parse_fleet({"workers": [
        {"name": f"hh{i}", "url": s.url, "metrics_endpoint": s.config.metrics_endpoint, "page_size": 16}
        for i, s in enumerate(sims)
    ]})
    agg = get_or_create_aggregator(fleet.settings)
    ray.get(agg.ping.remote())
    actors = [start_worker(w, fleet.settings, name_prefix="hostile-http-") for w in fleet.workers]
    ray.get([a.ready.remote() for a in actors], timeout=30)
    serve.run(
        build_app({"fleet": fleet.model_dump(mode="json"),
                   "router": {"policy": "least_loaded", "api_key": API_KEY, "max_body_bytes": MAX_BODY}}),
        name="hostile", route_prefix=PREFIX,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}", timeout=30)
    wait_for(lambda: len([w for w in client.get("/workers", headers=AUTH).json()["workers"]
                          if w["name"] in ("hh0", "hh1") and w["state"] != "down"]) == 2,
             30, what="both sim workers up in /workers")
    yield {"client": client, "port": serve_port, "sims": sims}
    client.close()
    serve.delete("hostile")
    ray.get([a.stop.remote() for a in actors], timeout=10)
    for a in actors:
        ray.kill(a, no_restart=True)
    for s in sims:
        s.stop()


def _error(r: httpx.Response) -> dict[str, Any]:
    """The router's OpenAI-style error object (asserts the shape)."""
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"] == "invalid_request_error", err
    return err


def _body_for(route: str, text: str) -> dict[str, Any]:
    """A valid body for the route: chat messages, a completion prompt, or /generate text."""
    if route in ("/route", "/v1/chat/completions"):
        return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    if route == "/v1/completions":
        return {"model": "m", "prompt": text, "max_tokens": 4}
    return {"text": text, "sampling_params": {"max_new_tokens": 4}}


def _serves_a_valid_request(c: httpx.Client) -> None:
    r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-kvroute-worker"] in ("hh0", "hh1")


# --- bodies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ALL_BODY_ROUTES)
@pytest.mark.parametrize("raw", [b"{not json", b"{\"messages\": [", b"", b"\xff\xfe\x00garbage", b"{\"a\": 1}}",
                                 b"NaN-ish {", b'{"messages": "\xc0\xaf"}'])
def test_malformed_json_is_a_400_naming_json(env, route, raw):
    c = env["client"]
    r = c.post(route, content=raw, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "invalid_json" and "not valid JSON" in err["message"]


@pytest.mark.parametrize("route", ALL_BODY_ROUTES)
@pytest.mark.parametrize("body", [[CHAT], "hello", 42, None, True])
def test_json_that_is_not_an_object_is_a_400(env, route, body):
    r = env["client"].post(route, content=json.dumps(body), headers=AUTH)
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "invalid_body" and "JSON object" in err["message"]


@pytest.mark.parametrize("route", ALL_BODY_ROUTES)
@pytest.mark.parametrize("body, field", [
    ({"model": "m"}, "body"),
    ({"model": "m", "max_tokens": 8, "temperature": 0}, "body"),
    ({"model": "m", "messages": "hello"}, "messages"),
    ({"model": "m", "messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"model": "m", "messages": 7}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": 1, "content": "hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": 3.5}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"text": {"a": 1}}, "text"),
])
def test_bodies_without_a_usable_prompt_are_a_400_naming_the_field(env, route, body, field):
    r = env["client"].post(route, json=body, headers=AUTH)
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "invalid_body"
    assert err["message"].startswith(f"{field}:"), err["message"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_max_tokens_that_is_not_a_number_is_refused_by_the_worker_and_passed_through(env, route):
    """The router forwards sampling parameters untouched; the worker (SGLang's pydantic models)
    refuses them with its own OpenAI-route error body, which the client gets as is."""
    body = {"model": "m", "max_tokens": "sixteen",
            **({"messages": CHAT["messages"]} if "chat" in route else {"prompt": "hello there"})}
    r = env["client"].post(route, json=body, headers=AUTH)
    assert r.status_code == 400
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and "max_tokens" in err["message"], err
    assert r.headers["x-kvroute-worker"] in ("hh0", "hh1")


@pytest.mark.parametrize("route", ALL_BODY_ROUTES)
def test_a_body_above_max_body_bytes_is_a_413_with_or_without_content_length(env, route):
    c = env["client"]
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()
    r = c.post(route, content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    err = _error(r)
    assert err["code"] == "body_too_large" and str(MAX_BODY) in err["message"]

    def chunked():  # no content-length: the limit is enforced while streaming the body in
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = c.post(route, content=chunked(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and _error(r)["code"] == "body_too_large"
    # a body of exactly max_body_bytes is read
    exact = json.dumps(_body_for(route, "y hello " * 1000)).encode()
    exact = exact[:-1] + b" " * (MAX_BODY - len(exact)) + b"}"
    assert len(exact) == MAX_BODY
    r = c.post(route, content=exact, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]


NESTED_BODIES = {  # name → (body, beyond any parser's stack?)
    "array 30,000 deep": (b"[" * 30_000 + b"]" * 30_000, True),
    "messages 20,000 deep": (b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", True),
    "tools 980 deep": (b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + b"[" * 980 + b"]" * 980 + b"}",
                       False),
    "tools 900 deep": (b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + b"[" * 900 + b"]" * 900 + b"}",
                       False),
    "content part 980 deep": (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
                              + b"[" * 980 + b"]" * 980 + b"}]}]}", False),
}


@pytest.mark.parametrize("route", ALL_BODY_ROUTES)
@pytest.mark.parametrize("what", list(NESTED_BODIES))
def test_a_deeply_nested_json_body_is_a_400_never_a_500(env, route, what):
    """Nesting deeper than the parser's stack is the client's error (400), not a 500. Near the
    stack's depth (~900 – 1000 levels, which depends on the replica's own call depth) the body may
    also parse and go on to the worker; it is never a 5xx either way."""
    raw, too_deep = NESTED_BODIES[what]
    assert len(raw) <= MAX_BODY
    r = env["client"].post(route, content=raw, headers=AUTH)
    assert r.status_code < 500, (r.status_code, r.text[:200])
    if too_deep or r.json().get("error", {}).get("code") == "invalid_json":
        assert r.status_code == 400
        err = _error(r)
        assert err["code"] in ("invalid_json", "invalid_body") and "nested too deeply" in err["message"]


# --- policies and headers ------------------------------------------------------------------------


@pytest.mark.parametrize("route", ALL_BODY_ROUTES)
@pytest.mark.parametrize("policy", ["nope", "KV_AWARE", "least_loaded;rm -rf /", "x" * 2000, ""])
def test_an_unknown_policy_header_is_a_400_listing_the_valid_ones(env, route, policy):
    r = env["client"].post(route, json=_body_for(route, "hello"), headers={**AUTH, "x-kvroute-policy": policy})
    if policy == "":  # an empty header means "no override"
        assert r.status_code == 200
        return
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "unknown_policy"
    assert "least_loaded" in err["message"] and "kv_aware" in err["message"]


def _raw_http(port: int, request: bytes, timeout: float = 10) -> tuple[int | None, bytes]:
    """Send raw bytes; return (status or None if the server closed without one, raw response)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
                if b"\r\n\r\n" in b"".join(chunks) and b"content-length" not in b"".join(chunks).lower():
                    break
        except (ConnectionResetError, socket.timeout):
            pass
    data = b"".join(chunks)
    if not data.startswith(b"HTTP/1."):
        return None, data
    return int(data.split(b" ", 2)[1]), data


MAX_HEADERS = 64 * 1024  # RouterConfig.max_header_bytes default
HAPROXY_BUFSIZE = int(os.environ.get("RAY_SERVE_HAPROXY_TUNE_BUFSIZE", ray_env.HAPROXY_BUFSIZE))  # as Serve runs


def _request_with_header(size: int) -> bytes:
    body = json.dumps(CHAT).encode()
    return (f"POST {PREFIX}/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-junk: {'a' * size}\r\nconnection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("size, status", [(16 * 1024, 200), (MAX_HEADERS - 1024, 200), (MAX_HEADERS, 431),
                                          (HAPROXY_BUFSIZE // 2 + MAX_HEADERS // 2, 431),
                                          (1 << 20, 400), (8 << 20, 400)])
def test_headers_above_max_header_bytes_are_a_431_naming_the_limit(env, size, status):
    """The router bounds header size (before the key check) and never forwards such a request to a
    worker; HAProxy, Serve's ingress here, passes header blocks up to its buffer (128 KiB) so the
    router's 431 answers them, and refuses anything larger itself with a 400 — no Python runs."""
    got, raw = _raw_http(env["port"], _request_with_header(size))
    assert got == status, raw[:300]
    if status == 431:
        err = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "headers_too_large" and str(MAX_HEADERS) in err["message"] and "header" in err["message"]
    if status == 400:
        assert b"Bad request" in raw
    _serves_a_valid_request(env["client"])


def test_many_headers_do_not_break_the_router(env):
    headers = {**AUTH, **{f"x-h{i}": "v" * 50 for i in range(500)}}
    r = env["client"].post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code in (200, 400, 413, 431)
    _serves_a_valid_request(env["client"])


# --- the API key -----------------------------------------------------------------------------------


BAD_AUTH = [
    {},
    {"authorization": ""},
    {"authorization": "Bearer"},
    {"authorization": "Bearer wrong-key-123456"},
    {"authorization": f"Bearer {API_KEY[:-1]}"},
    {"authorization": f"Bearer {API_KEY}x"},
    {"authorization": f"Basic {API_KEY}"},
    {"authorization": API_KEY},
    {"x-api-key": API_KEY},
    {"authorization": f"Bearer {API_KEY.upper()}"},
]


@pytest.mark.parametrize("headers", BAD_AUTH, ids=[f"auth{i}" for i in range(len(BAD_AUTH))])
@pytest.mark.parametrize("method, route", [("POST", r) for r in ALL_BODY_ROUTES]
                         + [("GET", "/workers"), ("GET", "/v1/models"), ("GET", "/metrics")])
def test_a_missing_or_wrong_api_key_is_a_401_on_every_route_but_healthz(env, headers, method, route):
    r = env["client"].request(method, route, json=CHAT if method == "POST" else None, headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert API_KEY not in r.text


@pytest.mark.parametrize("headers", [{}, AUTH, {"authorization": "Bearer wrong-key-123456"}])
def test_fleet_changes_are_refused_when_no_admin_key_is_set_even_with_the_api_key(env, headers):
    c = env["client"]
    worker = {"name": "evil", "url": "http://127.0.0.1:9", "metrics_endpoint": "tcp://127.0.0.1:45999"}
    for r in (c.post("/admin/workers", json=worker, headers=headers), c.delete("/admin/workers/hh0", headers=headers)):
        assert r.status_code == 403
        err = r.json()["error"]
        assert err["code"] == "admin_disabled" and "admin_key" in err["message"]
    assert {w["name"] for w in c.get("/workers", headers=AUTH).json()["workers"]} >= {"hh0", "hh1"}
    assert "evil" not in {w["name"] for w in c.get("/workers", headers=AUTH).json()["workers"]}


def test_a_401_is_decided_before_the_body_is_read(env):
    """Unauthenticated clients cannot make the router parse (or even accept) a large body."""
    big = b"{" + b"x" * (4 * MAX_BODY)
    r = env["client"].post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_healthz_needs_no_key_and_the_bearer_scheme_is_case_insensitive(env):
    c = env["client"]
    h = c.get("/healthz")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = c.post("/route", json=CHAT, headers={"authorization": f"bearer {API_KEY}"})
    assert r.status_code == 200


def test_the_api_key_never_appears_in_what_the_router_returns(env):
    c = env["client"]
    texts = {
        "/healthz": c.get("/healthz"),
        "/workers": c.get("/workers", headers=AUTH),
        "/metrics": c.get("/metrics", headers=AUTH),
        "/v1/models": c.get("/v1/models", headers=AUTH),
        "route": c.post("/route", json=CHAT, headers=AUTH),
        "chat": c.post("/v1/chat/completions", json=CHAT, headers=AUTH),
        "stream": c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH),
        "bad json": c.post("/v1/chat/completions", content=b"{", headers=AUTH),
        "no prompt": c.post("/v1/completions", json={"model": "m"}, headers=AUTH),
        "bad policy": c.post("/route", json=CHAT, headers={**AUTH, "x-kvroute-policy": "nope"}),
        "413": c.post("/generate", content=b"x" * (MAX_BODY + 1), headers=AUTH),
        "401": c.post("/route", json=CHAT, headers={"authorization": f"Bearer {API_KEY}-nope"}),
        "upstream 400": c.post("/v1/completions", json={"prompt": "hi", "max_tokens": "x"}, headers=AUTH),
    }
    assert texts["/workers"].status_code == 200 and texts["chat"].status_code == 200
    for what, r in texts.items():
        assert API_KEY not in r.text, what
        assert all(API_KEY not in v for v in r.headers.values()), what


def test_the_api_key_never_appears_in_ray_logs(env):
    """Router, proxy, controller and worker logs of this session: the key (given in the app args and
    sent by every client above) is nowhere."""
    import ray

    try:
        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    except Exception:
        logs = Path("/tmp/ray/session_latest/logs")
    env["client"].post("/route", json=CHAT, headers={"authorization": f"Bearer {API_KEY}-nope"})
    time.sleep(0.5)  # let the replica flush its log lines
    files = [f for f in logs.rglob("*") if f.is_file()]
    assert any("serve" in str(f) for f in files), f"no Serve logs under {logs}"
    leaks = [str(f) for f in files if API_KEY.encode() in f.read_bytes()]
    assert leaks == []


def test_the_api_key_is_not_forwarded_to_the_workers(env, serve_port):
    """The worker sees the client's other headers, but never its Authorization header."""
    import ray
    from ray import serve

    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802
            self._send(200, b"{}")

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self._send(200, json.dumps({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode())

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    tmp = Path(env["sims"][0].config.metrics_endpoint[len("ipc://"):]).parent
    fleet = parse_fleet({"workers": [{"name": "hh-echo", "url": url, "metrics_endpoint": f"ipc://{tmp}/echo.metrics"}]})
    actor = start_worker(fleet.workers[0], fleet.settings, name_prefix="hostile-http-")
    try:
        ray.get(actor.ready.remote(), timeout=30)
        serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "router": {"api_key": API_KEY}}),
                  name="hostile-echo", route_prefix="/hostile-echo")
        with httpx.Client(base_url=f"http://127.0.0.1:{serve_port}/hostile-echo", timeout=10) as c:
            wait_for(lambda: any(w["name"] == "hh-echo" and w["state"] != "down"
                                 for w in c.get("/workers", headers=AUTH).json()["workers"]), 30, what="echo worker up")
            for _ in range(10):  # other workers share the aggregator: round-robin until the echo answers
                r = c.post("/v1/chat/completions", json=CHAT, headers={
                    **AUTH, "x-request-id": "abc", "x-kvroute-worker-hint": "1", "x-kvroute-policy": "round_robin"})
                if r.status_code != 200 or r.headers["x-kvroute-worker"] == "hh-echo":
                    break
        assert r.status_code == 200 and seen
        assert "authorization" not in seen[-1] and all(API_KEY not in v for v in seen[-1].values())
        assert seen[-1].get("x-request-id") == "abc"
        assert not any(k.startswith("x-kvroute-") for k in seen[-1])
    finally:
        serve.delete("hostile-echo")
        ray.get(actor.stop.remote(), timeout=10)
        ray.kill(actor, no_restart=True)
        server.shutdown()
        server.server_close()


# --- afterwards ------------------------------------------------------------------------------------


def test_after_all_of_that_the_router_still_serves_streaming_and_non_streaming(env):
    c = env["client"]
    _serves_a_valid_request(c)
    with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    h = c.get("/healthz").json()
    assert h["status"] == "ok" and h["workers"].get("down", 0) == 0


# --- Ray's own ports (the boundary kvroute relies on) ---------------------------------------------


def test_a_local_ray_listening_beyond_loopback_keeps_token_auth_on(ray_cluster):
    """A local Ray (as `kvroute demo` / `kvroute serve` without --address start one, and as this
    session's is) listens on every interface — GCS and raylet measured on '::' — and an open GCS
    runs anyone's code: so either its ports are loopback-only, or Ray's token auth is on."""
    import ipaddress

    import psutil
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    node = ray._private.worker.global_worker.node
    pids = [info.process.pid for kind in ("gcs_server", "raylet") for info in node.all_processes.get(kind, [])]
    assert pids
    listening = {(psutil.Process(pid).name(), c.laddr.ip, c.laddr.port)
                 for pid in pids for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"}
    assert listening
    exposed = {x for x in listening if not ipaddress.ip_address(x[1]).is_loopback}
    assert not exposed or (is_token_auth_enabled() and os.environ.get("RAY_AUTH_MODE") != "disabled"), exposed
