"""Side-by-side benchmark: one simulated fleet, the same traces through every router, one report.

    python -m bench.run --suite quick      # ≤ 10 min on 2 cores
    python -m bench.run --suite full

In one run: the earlier micro-benchmarks (`bench/decision.py`, `bench.ingest`) as subprocesses
(before the fleet starts: ingest brings its own Ray); then one fleet of N simulated SGLang workers
(same engine arguments each) and every target (`bench.targets`); then, per repetition × workload ×
rate, one seeded trace driven open-loop through every target in a shuffled order, the workers'
prefix caches flushed before each target; then router overhead at fixed concurrencies with tiny
outputs; then teardown. Writes bench/results/<suite>.md, <suite>.json and <suite>-*.png.

Time: the simulated engines run at time_scale 1.0, so every time here is wall-clock and equals
simulated time (no conversion). The workloads are sized (long prompts, a small KV pool, short
outputs) so the fleet saturates at request rates two cores can drive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import machine, report  # noqa: E402
from bench import profile as bench_profile  # noqa: E402
from bench.cpu import CpuMeter, keep_orphans, router_side_cpu_s  # noqa: E402
from bench.loadgen import Target, chat_body, run_closed, run_trace  # noqa: E402
from bench.workloads import make_trace, trace_digest, with_models  # noqa: E402

# ---------------------------------------------------------------------------------------- suites

ENGINE = {
    # same for every worker; a pool that holds three 4k-token shared-prefix system prompts (12 in
    # the fleet for 8 groups), so where a request lands decides whether its prefix is cached;
    # prefill-heavy prompts and short outputs so the fleet saturates at request rates (and SSE
    # chunk rates through the Python routers) that two shared cores can drive
    "time_scale": 1.0,
    "page_size": 16,
    "max_total_num_tokens": 12288,
    "max_running_requests": 32,
}

SP = {"groups": 8, "system_tokens": 4096, "question_tokens": 128, "output_tokens": 12}
MT = {"turns": 3, "context_tokens": 3072, "user_tokens": 128, "output_tokens": 12, "think_s": 0.2}
NS = {"prompt_tokens": 2048, "output_tokens": 12}
# Mooncake replay: every length ×1/8 (512-token blocks → 64 tokens), and the engine's pool and slots
# with it (the sim's H100 defaults of 400k tokens / 1024 requests, ÷ 8), so a worker caches as many
# of the trace's prompts as a real one would
MC = {"length_scale": 0.125}
MC_ENGINE = {**ENGINE, "max_total_num_tokens": 50_000, "max_running_requests": 128}

# the overhead phase of the quick suite: the floors, kvroute (two policies), each peer once
OVERHEAD_TARGETS = ["direct", "serve-random", "kvroute-kv_aware", "kvroute-round_robin", "sglang-cache_aware",
                    "sglang-cache_aware-nodelay", "ray-prefix"]

SUITES: dict[str, dict[str, Any]] = {
    "quick": {
        "workers": 4,
        "engine": ENGINE,
        "reps": 2,
        "duration_s": 2.0,  # arrival window of session starts per trial
        "warmup_s": 0.4,  # requests sent before this are not measured
        "drain_s": 30.0,
        "workloads": {
            "shared_prefix": {"rates": [12, 24], "params": SP},
            "multi_turn": {"rates": [8, 16], "params": MT},
            "no_sharing": {"rates": [12, 24], "params": NS},
        },
        "overhead": {"concurrency": [1, 16, 64], "requests": {"1": 20, "16": 64, "64": 128}, "reps": 2,
                     "max_tokens": 1, "targets": OVERHEAD_TARGETS},
        "ingest_args": ["--frames", "20000", "--rounds", "1", "--emitters", "8", "--seconds", "3"],
        "decision_args": ["--iters", "300", "--workers", "10,100"],
        "budget_s": 600,
    },
    "standard": {
        # the suite the README's headline comes from: the Mooncake replay and the designed workloads
        # with realistic outputs (128 tokens; the trace's own, ×1/8, for Mooncake), 60 s arrival
        # windows, 3 repetitions, tails pooled over all measured requests with bootstrap intervals.
        # 4 workers: at ~24 req/s of the replay the machine's 2 cores are busy (engines, routers,
        # Ray, load generator); 8 would measure the machine, not the routers.
        "workers": 4,
        "engine": MC_ENGINE,
        "reps": 3,
        "duration_s": 60.0,
        "warmup_s": 5.0,
        "drain_s": 30.0,
        "workloads": {
            "mooncake": {"rates": [20], "params": MC},
            "shared_prefix": {"rates": [12], "params": {**SP, "output_tokens": 128}},
            "multi_turn": {"rates": [8], "params": {**MT, "output_tokens": 128}},
            "no_sharing": {"rates": [12], "params": {**NS, "output_tokens": 128}},
        },
        # the peer as its users run it, with TCP_NODELAY forced on its accepted sockets (bench/nodelay):
        # its routing without the delayed-ACK stall, the stricter yardstick (bench/results/peer-fairness.md)
        "targets": ["kvroute-kv_aware", "kvroute-round_robin", "sglang-cache_aware-nodelay"],
        "overhead": {"concurrency": [1], "requests": {"1": 20}, "reps": 1, "max_tokens": 1,
                     "targets": OVERHEAD_TARGETS},
        "ingest_args": [], "decision_args": [],
        "budget_s": 2400,
    },
    "two_model": {
        # a two-model fleet (issue 19): workers 0-1 serve model-A, 2-3 model-B; a shared-prefix
        # group or a conversation asks for one model (groups alternate), every request through one
        # kvroute router vs one sglang-router per model (its multi-model gateway mode cannot start
        # offline: bench/sglang_peer.SGLANG_PER_MODEL_NOTE)
        "workers": 4,
        "engine": ENGINE,
        "models": ["model-A", "model-B"],
        "reps": 2,
        "duration_s": 30.0,
        "warmup_s": 3.0,
        "drain_s": 30.0,
        "workloads": {
            "shared_prefix": {"rates": [12], "params": {**SP, "output_tokens": 128}},
            "multi_turn": {"rates": [8], "params": {**MT, "output_tokens": 128}},
        },
        "targets": ["direct", "kvroute-kv_aware", "kvroute-round_robin", "sglang-cache_aware-nodelay",
                    "sglang-round_robin"],
        "overhead": {"concurrency": [1], "requests": {"1": 20}, "reps": 1, "max_tokens": 1,
                     "targets": ["direct", "kvroute-kv_aware", "sglang-cache_aware-nodelay"]},
        "ingest_args": [], "decision_args": [],
        "budget_s": 1200,
    },
    "lora": {
        # multi-LoRA serving (issue 33): every worker has the same 8 adapters loaded (at run time,
        # /load_lora_adapter, so kvroute discovers them from /v1/models); one 2k-token system prompt
        # shared by every request, adapters drawn with Zipf popularity. The engines cache the prompt
        # once per adapter (SGLang's radix cache keeps adapters apart): a pool of 12k tokens holds
        # ~5 of the 8 copies, so where each adapter's requests land decides whether they hit
        "workers": 4,
        "engine": {**ENGINE, "enable_lora": True, "max_loras_per_batch": 8},
        "lora_adapters": 8,
        "reps": 2,
        "duration_s": 30.0,
        "warmup_s": 3.0,
        "drain_s": 30.0,
        "workloads": {"multi_lora": {"rates": [12], "params": {"adapters": 8, "zipf_s": 1.0, "system_tokens": 2048,
                                                                "question_tokens": 128, "output_tokens": 64}}},
        "targets": ["kvroute-kv_aware", "kvroute-round_robin", "sglang-cache_aware-nodelay"],
        "overhead": {"concurrency": [1], "requests": {"1": 20}, "reps": 1, "max_tokens": 1,
                     "targets": ["kvroute-kv_aware", "sglang-cache_aware-nodelay"]},
        "ingest_args": [], "decision_args": [],
        "budget_s": 900,
    },
    "mooncake": {  # the real-trace replay alone (development; the standard suite runs it too)
        "workers": 4,
        "engine": MC_ENGINE,
        "reps": 1,
        "duration_s": 60.0,
        "warmup_s": 5.0,
        "drain_s": 60.0,
        "workloads": {"mooncake": {"rates": [20], "params": MC}},
        "overhead": {"concurrency": [1], "requests": {"1": 20}, "reps": 1, "max_tokens": 1,
                     "targets": OVERHEAD_TARGETS},
        "ingest_args": [], "decision_args": [],
        "budget_s": 1800,
    },
    "pd": {
        # prefill/decode disaggregation (docs/pd.md): 2 prefill + 2 decode sims, kvroute against
        # sglang-router's --pd-disaggregation (cache-aware prefill + power-of-two decode, and round
        # robin on both sides); the shared-prefix workload and the no-sharing control
        "workers": 4,
        "pd": [2, 2],
        "engine": ENGINE,
        "reps": 2,
        "duration_s": 4.0,
        "warmup_s": 0.5,
        "drain_s": 30.0,
        "workloads": {
            # 4 groups: the 2 prefill sims' pools hold 6 system prompts (as 4 workers hold 12 for 8 groups
            # in the other suites), so where a request's prefill lands decides whether it is cached
            "shared_prefix": {"rates": [8, 16], "params": {**SP, "groups": 4}},
            "no_sharing": {"rates": [8, 16], "params": NS},
        },
        "targets": ["kvroute-kv_aware", "kvroute-round_robin", "sglang-pd-cache_aware", "sglang-pd-round_robin"],
        "overhead": {"concurrency": [1, 16], "requests": {"1": 20, "16": 64}, "reps": 1, "max_tokens": 1,
                     "targets": ["kvroute-kv_aware", "sglang-pd-cache_aware"]},
        "ingest_args": [], "decision_args": [],
        "budget_s": 900,
    },
    "full": {
        "workers": 4,
        "engine": ENGINE,
        "reps": 3,
        "duration_s": 10.0,
        "warmup_s": 2.0,
        "drain_s": 60.0,
        "workloads": {
            "shared_prefix": {"rates": [6, 12, 18, 24, 30], "params": SP},
            "multi_turn": {"rates": [4, 8, 12, 16, 20], "params": {**MT, "turns": 4}},
            "no_sharing": {"rates": [4, 8, 12, 16, 20], "params": NS},
        },
        "overhead": {"concurrency": [1, 16, 64], "requests": {"1": 200, "16": 800, "64": 1600}, "reps": 3,
                     "max_tokens": 1, "targets": None},
        "ingest_args": [],
        "decision_args": [],
        "budget_s": 4 * 3600,
    },
}

log = logging.getLogger("bench.run")


# ---------------------------------------------------------------------------------------- info


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "cores": os.cpu_count(),
    }
    info["cpu"] = machine.cpu_model()
    mem = machine.memory_gb()
    if mem is not None:
        info["memory_gb"] = mem
    try:
        import ray

        info["ray"] = ray.__version__
    except Exception:
        pass
    try:
        from importlib.metadata import version

        info["sglang_router"] = version("sglang-router")
        info["aiohttp"] = version("aiohttp")
    except Exception:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                            timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "actors", "serve_app", "sim"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["git_dirty_paths"] = dirty.splitlines()
    except Exception:
        pass
    return info


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def run_sub(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """An earlier benchmark script as a subprocess; its Markdown output goes into the report."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        out, rc = p.stdout, p.returncode
        err = p.stderr[-2000:] if rc else ""
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, err = None, f"timed out after {timeout_s:.0f} s"
    return {"command": "python " + " ".join(argv), "returncode": rc, "stdout": out, "stderr": err,
            "seconds": round(time.monotonic() - t0, 1)}


# ---------------------------------------------------------------------------------------- runs


def seed_for(base: int, rep: int, w_idx: int, r_idx: int) -> int:
    return base * 10_000 + rep * 1000 + w_idx * 100 + r_idx


def target_app(name: str) -> str | None:
    """The Serve application that routes for a bench target (its replica's process family)."""
    if name == "kvroute-kv_aware":
        return "kvroute"  # FleetRunner's own app
    if name.startswith(("kvroute-", "serve-", "ray-")):
        return name
    return None


def _profiler(profile: Path | None, target: Target, stem: str, native: bool = False) -> bench_profile.Recorder | None:
    """With --profile: py-spy on a Serve-hosted target's router replica for the trial (sglang-router
    is a Rust binary: its CPU is measured, not profiled)."""
    app = target_app(target.name)
    if profile is None or app is None:
        return None
    pid = bench_profile.find_pid(rf"ServeReplica:{re.escape(app)}:")
    return None if pid is None else bench_profile.Recorder(pid, profile / f"{stem}.txt", native=native)


async def _poll(meter: CpuMeter, every_s: float = 5.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        meter.poll()


def model_check(trace: Any, results: list, per_worker: dict[str, dict[str, Any]],
                workers_of: dict[str, tuple[str, ...]], worker_urls: dict[str, str]) -> dict[str, dict[str, int]]:
    """Multi-model fleet: per model, requests sent for it and requests its own workers' engines
    counted during the trial — equal unless a router sent a request to another model's worker."""
    model_of = {s.sid: s.model for s in trace.sessions}
    name_of = {u: n for n, u in worker_urls.items()}
    out: dict[str, dict[str, int]] = {}
    for model, urls in workers_of.items():
        sent = sum(1 for r in results if model_of.get(r.sid) == model and r.status is not None)
        served = sum(per_worker.get(name_of[u], {}).get("requests", 0) for u in urls)
        out[model] = {"sent": sent, "served_by_its_workers": served}
    return out


async def run_trials(fleet: Any, targets: list[Target], suite: dict[str, Any], base_seed: int, progress,
                     dump: Path | None = None, profile: Path | None = None, native: bool = False) -> list[dict]:
    import httpx

    trials: list[dict] = []
    cells = [(rep, wi, w, ri, rate)
             for rep in range(suite["reps"])
             for wi, (w, spec) in enumerate(suite["workloads"].items())
             for ri, rate in enumerate(spec["rates"])]
    total = len(cells) * len(targets)
    t_start = time.monotonic()
    done = 0
    meter = CpuMeter()
    async with httpx.AsyncClient(timeout=30, trust_env=False) as admin:
        for rep, wi, workload, ri, rate in cells:
            spec = suite["workloads"][workload]
            seed = seed_for(base_seed, rep, wi, ri)
            trace = with_models(make_trace(workload, seed, rate, suite["duration_s"], **spec["params"]),
                                suite.get("models", ()))
            digest = trace_digest(trace)
            order = list(targets)
            random.Random(seed).shuffle(order)  # interleaved, in a different order per cell
            for target in order:
                fleet.check_alive()
                stale = await fleet.stale_view(admin, target)
                await fleet.flush(admin)
                await fleet.poke(admin)
                await asyncio.sleep(suite.get("settle_s", 0.1))  # the fresh reports reach the routers
                before = await fleet.stats(admin)
                recorder = _profiler(profile, target, f"{workload}-{rate:g}-{target.name}-rep{rep}", native)
                meter.start()
                poller = asyncio.create_task(_poll(meter))
                try:
                    results, wall = await run_trace(trace, target, drain_s=suite["drain_s"])
                finally:
                    poller.cancel()
                cpu = meter.stop()
                done_requests = sum(1 for r in results if r.status is not None)
                if recorder is not None and (raw := recorder.stop(requests=done_requests)) is not None:
                    raw.with_suffix(".top.txt").write_text(bench_profile.summarize(raw))
                after = await fleet.stats(admin)
                if dump is not None:
                    with open(dump / f"{workload}-{rate:g}-{target.name}-rep{rep}.jsonl", "w") as f:
                        f.writelines(json.dumps(r.as_row()) + "\n" for r in results)
                summary = report.summarize_trial(results, suite["warmup_s"], before, after)
                summary["cpu"] = cpu
                if len(suite.get("models", ())) > 1:
                    summary["models"] = model_check(trace, results, summary["per_worker"], fleet.workers_of(),
                                                    fleet.worker_urls)
                # the CPU is the whole trial's, warm-up included: per request answered in it (not only the
                # measured ones, which undercounted by the warm-up's share — ~9 % in a 60 s trial)
                ok = max(1, done_requests)
                summary["cpu_requests"] = done_requests
                fam = cpu["families_cpu_s"]
                side = router_side_cpu_s(fam, target.name, target_app(target.name))
                summary["router_cpu_ms_per_req"] = None if side is None else round(side / ok * 1e3, 3)
                summary["loadgen_cpu_ms_per_req"] = round(fam.get("load generator", 0.0) / ok * 1e3, 3)
                summary["engines_cpu_ms_per_req"] = round(fam.get("engines", 0.0) / ok * 1e3, 3)
                summary["foreign_cores"] = cpu["foreign_cores"]
                summary["bench_cores"] = cpu["bench_cores"]
                kv_workers = await fleet.kvroute_workers(admin, target)
                if kv_workers is not None:
                    summary["kvroute_states_after"] = {w["name"]: w["state"] for w in kv_workers}
                if stale is not None:
                    summary["stale_view_before_poke"] = stale
                trials.append({"rep": rep, "workload": workload, "rate": rate, "target": target.name,
                               "seed": seed, "trace": digest, "wall_s": round(wall, 2), "summary": summary})
                done += 1
                el = time.monotonic() - t_start
                progress(f"[{done}/{total} {el:5.0f}s eta {el / done * (total - done):4.0f}s] rep {rep} "
                         f"{workload} {rate}/s {target.name:22s} ok {summary['ok']}/{summary['requests']} "
                         f"ttft p50/p99 {report.fmt(summary['ttft_p50_ms'])}/{report.fmt(summary['ttft_p99_ms'])} ms "
                         f"hit {report.fmt((summary['cache_hit'] or 0) * 100)}% "
                         f"spread {[w['requests'] for w in summary['per_worker'].values()]} "
                         f"cpu other {cpu['foreign_cores']:.1f}")
    return trials


async def run_overhead(targets: list[Target], cfg: dict[str, Any], base_seed: int, progress,
                       model: str = "default") -> list[dict]:
    rows = []
    meter = CpuMeter()
    want = cfg.get("targets")
    targets = [t for t in targets if want is None or t.name in want]
    for rep in range(cfg["reps"]):
        for conc in cfg["concurrency"]:
            order = list(targets)
            random.Random(base_seed * 7 + rep * 100 + conc).shuffle(order)
            n = int(cfg["requests"][str(conc)] if str(conc) in cfg["requests"] else cfg["requests"][conc])
            for target in order:
                tag = f"o{rep}-{conc}-{target.name}"

                def body(i: int, tag: str = tag) -> bytes:  # unique tiny prompt: nothing cached, tiny output
                    return chat_body([{"role": "user", "content": f"ping {tag} {i}"}], cfg["max_tokens"], model)

                meter.start()
                results, span = await run_closed(target, conc, n, body, model=model)
                cpu = meter.stop()
                ok = [r for r in results if r.ok]
                e2e = [r.e2e_s for r in ok]
                ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
                row = {"rep": rep, "concurrency": conc, "target": target.name, "requests": len(results),
                       "errors": len(results) - len(ok), "rps": len(ok) / span if span > 0 else 0.0,
                       "e2e_p50_ms": report._ms(report.pct(e2e, 50)), "e2e_p99_ms": report._ms(report.pct(e2e, 99)),
                       "e2e_mean_ms": report._ms(sum(e2e) / len(e2e)) if e2e else None,
                       "ttft_p50_ms": report._ms(report.pct(ttft, 50)), "cpu": cpu}
                rows.append(row)
                progress(f"[overhead rep {rep} c={conc:3d}] {target.name:22s} {row['requests']:5d} req "
                         f"e2e p50 {report.fmt(row['e2e_p50_ms'], digits=2)} ms  {row['rps']:.0f} req/s  "
                         f"cpu other {cpu['foreign_cores']:.1f}")
    return rows


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    # the benchmark's own loopback Ray (set here, not on import: importing bench.run — as
    # bench.routesim and the tests do — must not change how another Ray in the process starts)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    keep_orphans()  # before anything starts: what detaches stays in this run's process tree
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    ap.add_argument("--name", default=None, help="results file stem (default: the suite name)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--targets", default=None, help="comma-separated subset (development only)")
    ap.add_argument("--workloads", default=None, help="comma-separated subset (development only)")
    ap.add_argument("--reps", type=int, default=None, help="override repetitions (development only)")
    ap.add_argument("--duration", type=float, default=None, help="override the arrival window (development only)")
    ap.add_argument("--rates", default=None, help="override rates for every workload, e.g. 8,16 (development only)")
    ap.add_argument("--kv-events", action="store_true",
                    help="engines publish KV events and kvroute's exact prefix mode (router tokenizer: sim) runs as "
                         "one more target. Before serve_app fix d4a918b, KV events in the fleet switched the "
                         "default-mode routers' affinity off (see bench/results/quick-kv-events.md)")
    ap.add_argument("--kv", action="append", default=[], metavar="KNOB=VALUE",
                    help="a kv_aware knob for every kvroute target (development only), e.g. --kv live_weight=0")
    ap.add_argument("--router", action="append", default=[], metavar="SECTION.KEY=JSON",
                    help="a router setting for every kvroute target, e.g. --router prefix_index.cache_share=0 "
                    "(named in the report's overrides)")
    ap.add_argument("--settings", action="append", default=[], metavar="KEY=JSON",
                    help="a metrics-plane setting (the fleet file's settings:) for every kvroute target, e.g. "
                    "--settings coalesce_s=0.1 (named in the report's overrides)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="record every Serve-hosted target's router replica with py-spy during its trials; "
                         "raw stacks and their top entries go to DIR (see bench/profile.py)")
    ap.add_argument("--profile-native", action="store_true",
                    help="with --profile: C/C++ frames too (py-spy --native; slower to record)")
    ap.add_argument("--dump", default=None, metavar="DIR",
                    help="write every request's result (per trial) and every kvroute decision (router "
                         "decision_log, one file per kvroute target) as JSON lines to DIR, for diagnosis")
    ap.add_argument("--workers", type=int, default=None, help="override the suite's number of workers")
    ap.add_argument("--dp-size", type=int, default=1,
                    help="attention-DP ranks per worker (sim --dp-size; kvroute's fleet dp_size; sglang-router "
                    "--dp-aware, except in PD mode: see docs/pd.md), e.g. --workers 2 --dp-size 2, or "
                    "--suite pd --dp-size 2 for prefill and decode sims with 2 ranks each")
    ap.add_argument("--no-sub", action="store_true", help="skip the ingest/decision subprocess benchmarks")
    ap.add_argument("--no-overhead", action="store_true", help="skip the overhead phase")
    ap.add_argument("-v", "--verbose", action="store_true")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    suite = json.loads(json.dumps(SUITES[ns.suite]))
    overrides = []
    if ns.workloads:
        keep = ns.workloads.split(",")
        suite["workloads"] = {k: v for k, v in suite["workloads"].items() if k in keep}
        overrides.append(f"workloads={ns.workloads}")
    if ns.reps:
        suite["reps"] = ns.reps
        suite["overhead"]["reps"] = ns.reps
        overrides.append(f"reps={ns.reps}")
    if ns.duration:
        suite["duration_s"] = ns.duration
        suite["warmup_s"] = min(suite["warmup_s"], ns.duration / 4)
        overrides.append(f"duration={ns.duration}")
    if ns.rates:
        rates = [float(x) for x in ns.rates.split(",")]
        for spec in suite["workloads"].values():
            spec["rates"] = rates
        overrides.append(f"rates={ns.rates}")
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = ns.name or ns.suite
    t_run = time.monotonic()

    def progress(msg: str) -> None:
        print(f"{time.monotonic() - t_run:6.1f}s  {msg}", flush=True)

    doc: dict[str, Any] = {"suite": ns.suite, "command": command, "overrides": overrides,
                           "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(),
                           "loadavg_start": loadavg(), "config": suite, "seed": ns.seed}

    # 1. the earlier benchmarks, before our Ray starts (bench.ingest runs its own)
    subs: dict[str, Any] = {}
    if not ns.no_sub:
        progress("decision-cost benchmark (bench/decision.py) …")
        subs["decision"] = run_sub(["bench/decision.py", *suite["decision_args"]], 300)
        progress(f"  done in {subs['decision']['seconds']} s (rc {subs['decision']['returncode']})")
        progress("ingest/freshness benchmark (bench.ingest) …")
        subs["ingest"] = run_sub(["-m", "bench.ingest", *suite["ingest_args"]], 600)
        progress(f"  done in {subs['ingest']['seconds']} s (rc {subs['ingest']['returncode']})")
    doc["sub_benchmarks"] = subs

    # 2. one fleet, every target
    from bench.targets import BenchFleet

    enabled = tuple(ns.targets.split(",")) if ns.targets else (tuple(suite["targets"]) if suite.get("targets") else None)
    suite["kv_events"] = bool(ns.kv_events)
    from bench.targets import STREAM_BATCHING_MS

    suite["stream_batching_ms"] = STREAM_BATCHING_MS  # kvroute's default, and the Serve floors relay alike
    from serve_app.config import RouterConfig

    suite["stream_hold_reads"] = RouterConfig.model_fields["stream_batching_hold_reads"].default
    if ns.kv_events:
        overrides.append("kv-events")
    knobs = {k: float(v) for k, _, v in (kv.partition("=") for kv in ns.kv)}
    if knobs:
        suite["kv_aware"] = knobs
        overrides.append("kv=" + ",".join(ns.kv))
    router_args: dict[str, Any] = {"kv_aware": knobs} if knobs else {}
    if ns.router:
        from bench.overrides import parse_router_overrides

        router_args = {**router_args, **parse_router_overrides(ns.router)}
        suite["router"] = router_args
        overrides.append("router=" + ",".join(ns.router))
    plane: dict[str, Any] = dict(suite.get("settings") or {})
    if ns.settings:
        from bench.overrides import parse_router_overrides

        plane = {**plane, **parse_router_overrides(ns.settings, "--settings")}
        suite["settings"] = plane
        overrides.append("settings=" + ",".join(ns.settings))
    dump = Path(ns.dump).resolve() if ns.dump else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    if ns.workers is not None:
        suite["workers"] = ns.workers
        overrides.append(f"workers={ns.workers}")
    suite["dp_size"] = ns.dp_size
    if ns.dp_size > 1:
        overrides.append(f"dp_size={ns.dp_size}")
    fleet = BenchFleet(suite["workers"], suite["engine"], verbose=ns.verbose, progress=progress,
                       models=tuple(suite.get("models", ())),
                       targets_enabled=enabled, kv_events=suite["kv_events"],
                       router_args=router_args, plane_settings=plane, decision_log_dir=dump,
                       dp_size=ns.dp_size, pd=tuple(suite["pd"]) if suite.get("pd") else None)
    trials: list[dict] = []
    overhead: list[dict] = []
    try:
        t0 = time.monotonic()
        targets = fleet.start()
        doc["startup_s"] = round(time.monotonic() - t0, 1)
        doc["targets"] = [{"name": t.name, "label": t.label, "notes": t.notes} for t in targets]
        progress(f"fleet and {len(targets)} targets up in {doc['startup_s']} s: {', '.join(t.name for t in targets)}")
        if suite.get("lora_adapters"):
            from bench.workloads import lora_names

            asyncio.run(fleet.load_adapters(lora_names(suite["lora_adapters"]), targets))
            progress(f"{suite['lora_adapters']} LoRA adapters loaded on every worker and seen by the kvroute targets")
        profile = Path(ns.profile).resolve() if ns.profile else None
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
        trials = asyncio.run(run_trials(fleet, targets, suite, ns.seed, progress, dump, profile, ns.profile_native))
        if not ns.no_overhead:
            overhead = asyncio.run(run_overhead(targets, suite["overhead"], ns.seed, progress,
                                                (suite.get("models") or ["default"])[0]))
    finally:
        progress("tearing down …")
        fleet.stop()
    doc["loadavg_end"] = loadavg()
    doc["trials"] = trials
    doc["overhead"] = overhead
    doc["elapsed_s"] = round(time.monotonic() - t_run, 1)

    raw = out_dir / f"{stem}.json"
    raw.write_text(json.dumps(doc, indent=1, default=str) + "\n")  # kept even if rendering fails
    from bench.render import render

    render(doc, out_dir, stem)
    progress(f"wrote {out_dir / (stem + '.md')}, {stem}.json and plots in {doc['elapsed_s']} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
