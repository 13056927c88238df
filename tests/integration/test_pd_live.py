"""A prefill/decode fleet of managed sims through the real router (Serve + worker actors +
aggregator): roles reach the router, every request is served by a pair that met in its bootstrap
room, the decode side's stream is what the client gets, /route names both workers (docs/pd.md)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.helpers import pd_pair_app, wait_for

pytestmark = pytest.mark.ray
NAMES = {"pd-prefill", "pd-decode"}


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    with pd_pair_app("pd", serve_port, tmp_path_factory.mktemp("pd")) as (client, fleet):
        yield {"client": client, "fleet": fleet}


def chat(content: str, **extra) -> dict:
    return {"model": "pd-model", "max_tokens": 5,
            "messages": [{"role": "system", "content": "shared system " * 60}, {"role": "user", "content": content}],
            **extra}


def test_requests_are_served_by_the_pair_and_relayed_from_the_decode_side(env):
    c = env["client"]
    workers = {w["name"]: w for w in c.get("/workers").json()["workers"] if w["name"] in NAMES}
    assert workers["pd-prefill"]["bootstrap_port"] == env["fleet"].workers[0].bootstrap_port
    for i in range(4):
        r = c.post("/v1/chat/completions", json=chat(f"question {i}"))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-worker"] == "pd-decode" and r.headers["x-kvroute-prefill-worker"] == "pd-prefill"
        assert r.json()["usage"]["completion_tokens"] == 5  # the decode side's answer (prefill's has 1 token)
    with c.stream("POST", "/v1/chat/completions", json=chat("streamed", stream=True)) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert sum(bool(json.loads(e)["choices"][0]["delta"].get("content")) for e in events[:-1]) == 5
    p = httpx.get(workers["pd-prefill"]["url"] + "/sim/stats").json()["disagg"]
    d = httpx.get(workers["pd-decode"]["url"] + "/sim/stats").json()["disagg"]
    assert p["transfers"] == 5 and d["received"] == 5 and p["recent_rooms"] == d["recent_rooms"]
    route = c.post("/route", json=chat("which pair?")).json()
    assert route["disaggregated"] and route["worker"] == "pd-decode"
    assert route["prefill"]["worker"] == "pd-prefill" and route["prefill"]["bootstrap_host"] == "127.0.0.1"
    # both kinds of server report KvMetrics to the plane
    wait_for(lambda: all(w["metrics"] is not None for w in c.get("/workers").json()["workers"] if w["name"] in NAMES),
             20, what="KvMetrics from the prefill and the decode sim")
