"""bench.dump_phases: the decode-phase fit separates a relay's fixed delay from per-token time."""

from __future__ import annotations

import json

from bench.dump_phases import load, report


def _row(sent: float, ttft: float, tokens: int, per_token: float, fixed: float, worker: str) -> dict:
    return {"sid": f"s{sent}", "turn": 0, "group": None, "sched_s": sent, "sent_s": sent, "ok": True, "status": 200,
            "error": None, "ttft_ms": ttft, "e2e_ms": ttft + fixed + per_token * (tokens - 1), "tokens": tokens,
            "prompt_tokens": 100, "cached_tokens": 0, "worker": worker}


def test_a_fixed_delay_at_the_end_shows_as_the_intercept_not_the_slope(tmp_path):
    for target, fixed in (("fast", 0.0), ("held", 60.0)):
        rows = [_row(10.0 + i, 50.0, 2 + (i % 100), 18.0, fixed, f"w{i % 2}") for i in range(200)]
        (tmp_path / f"mooncake-20-{target}-rep0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "decisions-dynamo-kv.jsonl").write_text(json.dumps(
        {"decide_ms": 10.0, "overlap_tokens": 5, "prompt_tokens": 100}) + "\n")
    rows, decisions = load(tmp_path, 5.0)
    lines = {line.split(" | ")[1]: line.split(" | ") for line in report(rows, decisions, 5.0).splitlines()
             if line.startswith("| mooncake")}
    # the fit: intercept = fixed delay − one token's time (tokens − 1 gaps), slope = per-token time
    assert float(lines["fast"][2]) == -18 and float(lines["held"][2]) == 42
    assert float(lines["fast"][3]) == float(lines["held"][3]) == 18.0
    assert "| dynamo-kv | 1 | 10.0 / 10.0 / 10.0 | 5.0 % |" in report(rows, decisions, 5.0)
