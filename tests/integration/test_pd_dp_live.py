"""A prefill/decode fleet whose sims each run 2 attention-DP ranks, through the real router (Serve +
worker actors + aggregator): each side's ranks are routing targets from their own KvMetrics, every
request is served on the prefill rank and the decode rank the router names, /route and /metrics
carry the ranks (docs/pd.md, "DP ranks in a PD pair")."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from tests.integration.helpers import pd_pair_app, wait_for

pytestmark = pytest.mark.ray
NAMES = {"pddp-prefill", "pddp-decode"}


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    with pd_pair_app("pddp", serve_port, tmp_path_factory.mktemp("pddp"), dp_size=2) as (client, fleet):
        yield {"client": client, "fleet": fleet}


def chat(i: int, **extra) -> dict:
    return {"model": "pddp-model", "max_tokens": 4,
            "messages": [{"role": "system", "content": f"system prompt {i % 3} " * 60},
                         {"role": "user", "content": f"question {i}"}], **extra}


def _finished_by_rank(url: str) -> list[int]:
    return [r["requests_finished_total"] for r in httpx.get(url + "/sim/stats", timeout=5).json()["ranks"]]


def test_every_request_is_served_on_the_prefill_and_decode_ranks_the_router_chose(env):
    c = env["client"]
    workers = {w["name"]: w for w in c.get("/workers").json()["workers"] if w["name"] in NAMES}
    p_url, d_url = workers["pddp-prefill"]["url"], workers["pddp-decode"]["url"]
    p0, d0 = _finished_by_rank(p_url), _finished_by_rank(d_url)
    chosen_p, chosen_d = Counter(), Counter()
    for i in range(8):
        r = c.post("/v1/chat/completions", json=chat(i, stream=i % 2 == 1))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-worker"] == "pddp-decode" and r.headers["x-kvroute-prefill-worker"] == "pddp-prefill"
        chosen_p[int(r.headers["x-kvroute-prefill-rank"])] += 1
        chosen_d[int(r.headers["x-kvroute-rank"])] += 1
    p1, d1 = _finished_by_rank(p_url), _finished_by_rank(d_url)
    assert [p1[k] - p0[k] for k in (0, 1)] == [chosen_p[0], chosen_p[1]]
    assert [d1[k] - d0[k] for k in (0, 1)] == [chosen_d[0], chosen_d[1]]
    ps = httpx.get(p_url + "/sim/stats", timeout=5).json()["disagg"]
    ds = httpx.get(d_url + "/sim/stats", timeout=5).json()["disagg"]
    assert ps["rank_conflicts"] == 0 and ps["bootstrap_timeouts"] == 0 and ds["waiting_timeouts"] == 0
    assert ps["recent_ranks"][-8:] == ds["recent_prefill_ranks"][-8:]  # each decode took its KV from its prefill rank
    route = c.post("/route", json=chat(99)).json()
    assert route["disaggregated"] and route["prefill"]["rank"] in (0, 1) and route["decode"]["rank"] in (0, 1)
    assert route["rank"] == route["decode"]["rank"]


def test_the_router_sees_and_exports_each_ranks_load(env):
    c = env["client"]
    wait_for(lambda: all(len(w["ranks"]) == 2 for w in c.get("/workers").json()["workers"] if w["name"] in NAMES),
             30, what="KvMetrics from both ranks of both PD workers")
    text = c.get("/metrics").text
    for worker in NAMES:
        for rank in (0, 1):
            assert f'kvroute_worker_rank_running_requests{{rank="{rank}",worker="{worker}"}}' in text
    assert 'kvroute_worker_role{role="prefill",worker="pddp-prefill"} 1.0' in text
