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
