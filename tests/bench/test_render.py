"""The overhead goal's verdict in bench/render.py (pure: no Ray, no fleet)."""

from __future__ import annotations

import pytest

from bench.render import DIRECT, KV, SERVE, evaluate_goals


def _oh(direct: float, serve: float, kv: float) -> dict:
    return {(16, DIRECT): {"e2e_p50_ms": direct}, (16, SERVE): {"e2e_p50_ms": serve},
            (16, KV): {"e2e_p50_ms": kv}}


@pytest.mark.parametrize("direct, serve, kv, met", [
    (10.0, 20.0, 21.0, True),    # adds 11 ms vs Serve's 10: 1.1×
    (10.0, 20.0, 22.0, False),   # 1.2×
    (300.0, 280.0, 260.0, True),  # both beat direct; kvroute adds less than bare Serve
    (300.0, 280.0, 290.0, False),  # both beat direct; kvroute adds more
])
def test_overhead_goal_verdict(direct, serve, kv, met):
    (goal,) = evaluate_goals({}, {}, _oh(direct, serve, kv))
    assert goal["met"] is met
    if serve <= direct:
        assert goal["value"] is None and "no ratio" in goal["detail"]


def test_bootstrap_interval_covers_the_estimate_and_narrows_with_more_requests():
    import random

    from bench.report import bootstrap_ci, ratio_ci

    rng = random.Random(3)
    small = [rng.expovariate(1.0) for _ in range(200)]
    big = [rng.expovariate(1.0) for _ in range(5000)]
    est, lo, hi = bootstrap_ci(small, 99)
    assert lo <= est <= hi
    e2, lo2, hi2 = bootstrap_ci(big, 99)
    assert lo2 <= e2 <= hi2 and (hi2 - lo2) < (hi - lo)
    assert abs(e2 - 4.6) < 0.5  # the exponential's p99 is ln(100) ≈ 4.6
    assert bootstrap_ci([1.0], 50) is None
    # a ratio whose interval lies wholly below 1 (half the latency) and one that straddles it
    fast = [v / 2 for v in big]
    r, rlo, rhi = ratio_ci(fast, big, 50)
    assert rhi < 1.0 and abs(r - 0.5) < 0.05
    same = [rng.expovariate(1.0) for _ in range(5000)]
    _, slo, shi = ratio_ci(same, big, 50)
    assert slo < 1.0 < shi


def test_pooled_tails_pool_requests_over_repetitions():
    from bench.report import pooled

    def trial(rep, ttft):
        return {"workload": "w", "rate": 1, "target": "t", "rep": rep,
                "summary": {"ttft_ms_all": ttft, "e2e_ms_all": ttft, "ok": len(ttft), "requests": len(ttft) + 1,
                            "span_s": 2.0, "prompt_tokens": 100, "cache_hit": 0.5}}

    g = pooled([trial(0, [1.0, 2.0]), trial(1, [3.0])], ["workload", "rate", "target"])[("w", 1, "t")]
    assert sorted(g["ttft"]) == [1.0, 2.0, 3.0] and g["ok"] == 3 and g["requests"] == 5
    assert g["rps"] == 3 / 4.0 and g["hit"] == 0.5 and g["reps"] == 2
