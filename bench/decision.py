"""Per-decision cost of every policy at 10/100/1,000/10,000 workers with a 4k-token chat prompt.

Run: python bench/decision.py [--iters N] [--workers 10,100,1000,10000]

Prints p50/p99 µs per call of: RouteRequest extraction (body → facts, once per request),
prefix-index lookup (overlap for that prompt), each policy's `choose` on a `FleetView` (as the
router holds the fleet), kv_aware on a plain list for reference, the per-request ledger
bookkeeping including the refresh of the routed worker's view, the pieces' cycle, and the
router's own cycle: `RouterCore.route` (prefix overlap, fleet refresh, kv_aware, ledger and prefix
bookkeeping) plus the ticket's first token and end, on a RouterCore fed the same fleet as records.
Every worker overlaps the prompt by its ~40-block system prompt (the hard case) and 4 by more.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import machine  # noqa: E402
from serve_app.config import RouterConfig  # noqa: E402
from serve_app.follower import FleetFollower, WorkerRecord  # noqa: E402
from serve_app.ledger import Ledger, refresh_fleet  # noqa: E402
from serve_app.policies import POLICIES, WorkerView, get_policy  # noqa: E402
from serve_app.policies.fleet import FleetView  # noqa: E402
from serve_app.prefix_index import PrefixIndex  # noqa: E402
from serve_app.request_facts import facts_from_body  # noqa: E402
from serve_app.router import RouterCore  # noqa: E402

TARGET_P50_US = {10: 5, 100: 20, 1000: 150}  # kv_aware decision targets
CYCLE_TARGET_P50_US = {1000: 300, 10_000: 1000}  # the whole routing cycle (issue 17)


def body_4k(i: int = 0) -> dict:
    """A chat of ~4k tokens (~16k chars): long system prompt, some history, a question."""
    system = "You are a careful assistant. Follow the policy below exactly. " * 130
    history = [
        {"role": "user", "content": f"Earlier question {k}: " + "details " * 60}
        for k in range(3)
    ]
    return {
        "model": "m",
        "max_tokens": 256,
        "messages": [{"role": "system", "content": system}, *history,
                     {"role": "user", "content": f"Question {i}: what now? " + "context " * 200}],
    }


def fleet(n: int, rng: random.Random) -> list[WorkerView]:
    out = []
    for i in range(n):
        running = rng.randrange(0, 48)
        out.append(WorkerView(
            f"w{i}", f"http://10.0.{i // 250}.{i % 250}:30000", "live" if i % 17 else "idle",
            page_size=16, running=running, total_slots=48, waiting=rng.randrange(0, 3),
            kv_active_blocks=rng.randrange(0, 30_000), kv_total_blocks=32_768,
            pending=rng.randrange(0, 3), pending_prefill_blocks=rng.randrange(0, 300),
            pending_kv_blocks=rng.randrange(0, 300), hot_blocks=rng.randrange(0, 2000),
        ))
    return out


async def _no_aggregator() -> object:
    raise RuntimeError("bench/decision.py feeds the RouterCore by hand")


def router_core(views: list[WorkerView], body: dict) -> RouterCore:
    """A RouterCore holding `views` as follower records (reported figures), with the same prefix
    history as the bench's own index."""
    follower = FleetFollower(_no_aggregator)
    core = RouterCore(RouterConfig(policy="kv_aware", seed=0), follower, "bench")
    now = time.monotonic()
    for v in views:
        follower.workers[v.name] = WorkerRecord(
            name=v.name, url=v.url, page_size=v.page_size, state=v.state, healthy=True, metrics_at=now,
            heartbeat_at=now, metrics={"request_active_slots": v.running, "request_total_slots": v.total_slots,
                                       "num_requests_waiting": v.waiting, "kv_active_blocks": v.kv_active_blocks,
                                       "kv_total_blocks": v.kv_total_blocks})
    core.on_fleet_update(list(follower.workers))
    for i, v in enumerate(views):
        core.prefix.record(v.name, core.facts(body_4k(10_000 + i)).block_hashes[:40])
    own = core.facts(body).block_hashes
    for k in range(min(4, len(views))):
        core.prefix.record(views[k].name, own[: 60 * (k + 1)])
    return core


def timeit(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    for _ in range(min(50, iters)):
        fn()
    samples = []
    gc.disable()
    try:
        for _ in range(iters):
            t = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - t)
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(len(samples) * 0.99) - 1] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--workers", default="10,100,1000,10000")
    args = ap.parse_args()
    sizes = [int(x) for x in args.workers.split(",")]
    rng = random.Random(0)

    body = body_4k()
    facts = facts_from_body(body)
    rows: list[tuple[str, int, float, float]] = []
    p50, p99 = timeit(lambda: facts_from_body(body), args.iters)
    rows.append(("extract RouteRequest (body → facts)", 0, p50, p99))

    for n in sizes:
        views = fleet(n, rng)
        index = PrefixIndex(max_entries=2_000_000)
        # every worker has seen other prompts with the same system prompt (so every worker
        # overlaps ~40 blocks: the hard case), and 4 hold longer parts of this very prompt
        for i, v in enumerate(views):
            index.record(v.name, facts_from_body(body_4k(10_000 + i)).block_hashes[:40])
        for k in range(min(4, n)):
            index.record(views[k].name, facts.block_hashes[: 60 * (k + 1)])
        ov = index.overlap(facts.block_hashes)
        req = facts.with_overlap(ov)
        iters = args.iters if n <= 100 else max(200, args.iters // (4 if n <= 1000 else 10))
        p50, p99 = timeit(lambda: index.overlap(facts.block_hashes), iters)
        rows.append(("prefix-index overlap", n, p50, p99))
        fv = FleetView(views)
        for name in sorted(POLICIES):
            policy = get_policy(name)
            r = random.Random(1)
            p50, p99 = timeit(lambda: policy.choose(req, fv, r), iters)
            rows.append((f"decision: {name}", n, p50, p99))
        policy = get_policy("kv_aware")
        few = facts.with_overlap({w: b for w, b in ov.items() if b > 40})  # only the 4 deep holders
        p50, p99 = timeit(lambda: policy.choose(few, fv, r), iters)
        rows.append(("decision: kv_aware, only 4 workers with overlap", n, p50, p99))
        cold = facts.with_overlap({})  # a prompt no worker holds (no reused prefixes: turn-taking)
        p50, p99 = timeit(lambda: policy.choose(cold, fv, r), iters)
        rows.append(("decision: kv_aware, cold prompt (no overlap)", n, p50, p99))
        p50, p99 = timeit(lambda: policy.choose(req, views, r), iters)
        rows.append(("(ref) kv_aware on a plain list (no cached columns)", n, p50, p99))
        # per request the router re-applies the ledger to the one worker it just routed to
        ledger = Ledger()
        base = {v.name: v for v in views}

        def route_update() -> None:
            ledger.on_routed("x", views[0].name, 100)
            refresh_fleet(fv, base, ledger)
            ledger.on_finished("x")

        p50, p99 = timeit(route_update, iters)
        rows.append(("ledger on_routed + refresh_fleet + on_finished", n, p50, p99))
        r = random.Random(2)

        def cycle() -> None:  # what one request costs the router once the body is parsed
            ov = index.overlap(facts.block_hashes)
            d = policy.choose(facts.with_overlap(ov), fv, r)
            ledger.on_routed("y", d.worker, facts.prompt_blocks, ov.get(d.worker, 0))
            refresh_fleet(fv, base, ledger)
            ledger.on_finished("y")

        p50, p99 = timeit(cycle, iters)
        rows.append(("pieces' cycle: overlap + kv_aware + ledger + refresh", n, p50, p99))
        core = router_core(views, body)
        routed = core.facts(body)

        def router_cycle() -> None:  # the router's own path once the body is parsed
            ticket = core.route(routed)
            ticket.first_token()
            ticket.finished()

        p50, p99 = timeit(router_cycle, iters)
        rows.append(("full cycle: RouterCore.route + ticket first_token/finished", n, p50, p99))

    print(f"# Decision cost — {machine.describe()}\n")
    print("command: `" + " ".join(["python bench/decision.py", *sys.argv[1:]]) + "`\n")
    print("| what | workers | p50 µs | p99 µs | p50 target |")
    print("|---|---:|---:|---:|---:|")
    for what, n, a, b in rows:
        target = f"≤ {TARGET_P50_US[n]}" if what == "decision: kv_aware" and n in TARGET_P50_US else ""
        if what.startswith("full cycle") and n in CYCLE_TARGET_P50_US:
            target = f"≤ {CYCLE_TARGET_P50_US[n]}"
        print(f"| {what} | {n or '—'} | {a:.1f} | {b:.1f} | {target} |")


if __name__ == "__main__":
    main()
