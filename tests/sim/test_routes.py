"""The sim's HTTP surface is its claimed release's, route for route (issue 15, item 3).

The expectations below were read from each release's `sglang/srt/entrypoints/http_server.py`
(and `v1_loads.py`) in the wheel `pip download --no-deps sglang==X`; they are written out here
independently of `sim.sglang_shapes.HTTP_ROUTES`, so a wrong table fails.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from sim.config import SimConfig
from sim.server import SimServer
from sim.sglang_shapes import HTTP_ROUTES, WIRE_FORMS, http_routes, release_of

# every route every release has
_COMMON = {"/health", "/health_generate", "/v1/models", "/get_model_info", "/get_server_info", "/metrics",
           "/flush_cache", "/generate", "/v1/completions", "/v1/chat/completions",
           "/load_lora_adapter", "/unload_lora_adapter"}  # (LoRA: read in 0.4.9's and 0.5.23's http_server.py)
_NEW_NAMES = {"/model_info", "/server_info", "/v1/loads"}
EXPECTED: dict[str, set[str]] = {
    "0.4.9": _COMMON | {"/get_load"},
    "0.5.8": _COMMON | _NEW_NAMES | {"/get_load"},
    "0.5.10": _COMMON | _NEW_NAMES | {"/get_load"},
    "0.5.12": _COMMON | _NEW_NAMES | {"/get_load"},
    "0.5.14": _COMMON | _NEW_NAMES | {"/get_load"},
    "0.5.20": _COMMON | _NEW_NAMES | {"/get_load"},
    "0.5.23": _COMMON | _NEW_NAMES,  # /get_load removed: sglang-router's power_of_two gets 404
}
ALL_PATHS = sorted(set().union(*EXPECTED.values()))
# a request each route accepts (status not 404/405); POST bodies may be refused with 400, that is fine
_PROBE = {
    "/flush_cache": ("POST", None), "/generate": ("POST", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    "/v1/completions": ("POST", {"model": "m", "prompt": "hi", "max_tokens": 1}),
    "/v1/chat/completions": ("POST", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    "/load_lora_adapter": ("POST", {"lora_name": "a", "lora_path": "/p/a"}),
    "/unload_lora_adapter": ("POST", {"lora_name": "a"}),
}


def test_every_wire_form_has_an_expectation():
    assert {release_of(f) for f in WIRE_FORMS} == set(EXPECTED)
    assert set(HTTP_ROUTES) == set(ALL_PATHS)


@pytest.mark.parametrize("form", sorted(WIRE_FORMS))
def test_table_matches_the_release(form):
    assert set(http_routes(form)) == EXPECTED[release_of(form)]


@pytest.fixture(scope="module", params=sorted(WIRE_FORMS))
def client(request):
    server = SimServer(SimConfig(wire=request.param, model_name="m", time_scale=0.01))
    try:
        with TestClient(server.app) as c:
            yield request.param, c
    finally:
        server.close()


def test_the_sim_serves_exactly_its_releases_routes(client):
    form, c = client
    expected = EXPECTED[release_of(form)]
    for path in ALL_PATHS:
        method, body = _PROBE.get(path, ("GET", None))
        r = c.request(method, path, json=body)
        if path in expected:
            assert r.status_code not in (404, 405), (form, path, r.status_code, r.text)
            assert r.status_code < 500, (form, path, r.status_code, r.text)
        else:
            # exactly what SGLang's FastAPI app answers for a route it does not have
            assert r.status_code == 404, (form, path, r.status_code)
            assert r.json() == {"detail": "Not Found"}
            assert r.headers["content-type"] == "application/json"
    assert c.get("/sim/stats").status_code == 200  # the sim's own route, every release


def test_unknown_routes_and_methods_answer_like_fastapi(client):
    form, c = client
    for path in ("/nope", "/get_loads", "/v1/load", "/generate_from_file", "/v1/models/x/y/z"):
        r = c.get(path)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), (form, path)
    r = c.post("/health")
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
    assert r.headers["allow"] == "GET"
    r = c.delete("/flush_cache")
    assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}


def test_version_fields_name_the_claimed_release(client):
    form, c = client
    release = release_of(form)
    assert c.get("/get_server_info").json()["version"] == release
    if "/v1/loads" in EXPECTED[release]:
        assert c.get("/v1/loads").json()["version"] == release


def test_legacy_get_load_keeps_the_shape_power_of_two_reads(client):
    form, c = client
    if "/get_load" not in EXPECTED[release_of(form)]:
        pytest.skip("no /get_load in this release")
    rows = c.get("/get_load").json()
    # sglang-router's LoadMonitor sums `num_tokens` over the list's entries (one per DP rank)
    assert isinstance(rows, list) and len(rows) == 1
    assert set(rows[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"}


def test_sglangs_http_exception_handler_does_not_touch_unknown_routes():
    """SGLang ≥ 0.5.8 registers an error-envelope handler for `fastapi.HTTPException`; the router's
    404/405 are Starlette's HTTPException (its base class), so they keep FastAPI's default body —
    which is why the sim's plain FastAPI 404 is SGLang's."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.exception_handler(HTTPException)
    async def envelope(request: Request, exc: HTTPException) -> JSONResponse:  # as http_server.py does
        return JSONResponse({"object": "error", "message": exc.detail, "code": exc.status_code},
                            status_code=exc.status_code)

    @app.get("/health")
    async def health() -> dict:
        return {}

    c = TestClient(app)
    assert (c.get("/get_load").status_code, c.get("/get_load").json()) == (404, {"detail": "Not Found"})
    assert c.post("/health").json() == {"detail": "Method Not Allowed"}
