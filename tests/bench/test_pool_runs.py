"""bench.pool_runs: pooled TTFT and end-to-end ratios over several runs' repetitions."""

from __future__ import annotations

import json

from bench.pool_runs import main


def _trial(target: str, rep: int, ttft: list[float], e2e: list[float]) -> dict:
    s = {"ttft_ms_all": ttft, "e2e_ms_all": e2e, "ok": len(ttft), "requests": len(ttft), "span_s": 10.0,
         "prompt_tokens": 100, "cache_hit": 0.1, "ttft_p50_ms": sorted(ttft)[len(ttft) // 2],
         "ttft_p99_ms": max(ttft), "e2e_p50_ms": sorted(e2e)[len(e2e) // 2], "e2e_p99_ms": max(e2e)}
    return {"target": target, "rep": rep, "workload": "mooncake", "rate": 20, "summary": s}


def test_both_runs_are_pooled_and_e2e_ratios_are_given(tmp_path, capsys):
    paths = []
    for run, scale in (("a", 1.0), ("b", 1.0)):
        base = [100.0 + i for i in range(200)]
        doc = {"trials": [_trial("kvroute-kv_aware", 0, [scale * v for v in base], [4 * v for v in base]),
                          _trial("dynamo-kv", 0, [2 * v for v in base], [2 * v for v in base])]}
        p = tmp_path / f"{run}.json"
        p.write_text(json.dumps(doc))
        paths.append(str(p))
    assert main(paths) == 0
    out = capsys.readouterr().out
    assert "2 repetitions, 400 requests" in out
    row = next(line for line in out.splitlines() if line.startswith("| dynamo-kv |")).split(" | ")
    # TTFT: the subject's is half Dynamo's at every percentile; E2E: twice
    assert row[1] == "400" and row[3].startswith("0.50 [") and row[4].startswith("0.50 [")
    assert row[5].startswith("2.00 [") and row[6].startswith("2.00 [")
    assert "dynamo-kv 0.50 / 0.50 / 2.00 / 2.00" in out  # per repetition, TTFT p50 / p99, E2E p50 / p99
