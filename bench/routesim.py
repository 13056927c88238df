"""Routing in virtual time: kvroute's decision plane over simulated engines, no sockets, no clock.

A development tool for the routing policies. The simulated SGLang engine (`sim.engine.Engine`:
FIFO admission, continuous batching, radix prefix cache, KvMetrics at SGLang's cadence) is pure
and clock-free, so a whole fleet and kvroute's own router pieces — `facts_from_body`,
`PrefixIndex`, `Ledger`, `FleetView` and the policies — can be driven by one discrete-event loop
in simulated seconds. A trace of minutes runs in seconds and the same seed gives the same result,
which makes policy changes comparable on a shared 2-core machine where the wall-clock benchmark
(`bench.run`) is noisy. What it leaves out: HTTP, the aggregator hop (modelled as a fixed report
delay) and every peer's real implementation — figures that compare with peers come from
`bench.run` only. `cache_aware*` here is a *model* of sglang-router's cache_aware policy (approximate
per-worker prefix tree of request text, LRU-bounded; balance thresholds on in-flight counts),
kept as a yardstick for tuning. Two yardsticks no router can implement have perfect information:
they copy every engine (with its batch in flight and the requests routed to it still in transit),
run each copy forward with the request added, and pick the worker where that is cheapest, knowing
neither future arrivals nor anything about them. `oracle` minimises the request's own first-token
time (greedy); `oracle_sum` minimises what it adds to the sum of first-token times there — its own
wait plus the delay it causes every request there still before its first token (the ones it shares
a prefill batch with). What they know that a router cannot: each engine's exact queue, batch in
flight and its remaining time, prefix-cache contents, KV reservations and timing model.

Each measured request's time to first token is split into `PARTS` (`Result.breakdown`,
`--breakdown`): transit, the batch in flight when it landed, prefill batches ahead of it, waiting
for KV or a slot, its own prefill and the other prompts prefilled in its batch.

    python -m bench.routesim [--workload shared_prefix] [--rates 12,24,30] [--duration 60]
                             [--policies kv_aware,cache_aware,round_robin,oracle_sum] [--seeds 1]
                             [--suite standard] [--breakdown] [--kv KNOB=VALUE]
"""

from __future__ import annotations

import argparse
import copy
import heapq
import itertools
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run import ENGINE, MC, MC_ENGINE, MT, NS, SP, SUITES  # noqa: E402
from bench.workloads import build_messages, make_trace  # noqa: E402
from bench.overrides import parse_router_overrides  # noqa: E402
from serve_app.config import RouterConfig  # noqa: E402
from serve_app.follower import FleetFollower, WorkerRecord  # noqa: E402
from serve_app.router import RouterCore  # noqa: E402
from sim import tokenizer  # noqa: E402
from sim.config import EngineConfig  # noqa: E402
from sim.engine import Batch, BatchKind, Engine, KvReport, NullListener, SimRequest  # noqa: E402

PARAMS = {"shared_prefix": SP, "multi_turn": MT, "no_sharing": NS, "mooncake": MC}
ENGINES = {"mooncake": MC_ENGINE}


@dataclass
class Knobs:
    net_s: float = 0.001  # router ↔ worker, each way
    report_delay_s: float = 0.004  # engine report → router's view (actor push + aggregator + follower)
    # how much later than it was produced the router believes a report was produced (a follower
    # that dates a report by when it applied the delta, late when its replica is CPU-starved)
    report_date_bias_s: float = 0.0
    idle_after_s: float = 3.0


class CacheAwareModel:
    """A model of sglang-router's cache_aware (defaults: cache_threshold 0.3, balance_abs_threshold
    64, balance_rel_threshold 1.5, LRU-bounded trees): when in-flight counts are imbalanced route to
    the least loaded; otherwise to the worker whose tree matches the longest prefix of the request
    text if the match rate exceeds the threshold, else to the worker with the smallest tree."""

    name = "cache_aware"

    def __init__(self, names: list[str], *, cache_threshold: float = 0.3, abs_thr: int = 64,
                 rel_thr: float = 1.5, max_tree_chars: int = 2**24) -> None:
        self.names = names
        self.cache_threshold, self.abs_thr, self.rel_thr = cache_threshold, abs_thr, rel_thr
        self.max_chars = max_tree_chars
        self.trees: dict[str, dict[str, float]] = {n: {} for n in names}  # chunk-prefix → last use
        self.size: dict[str, int] = dict.fromkeys(names, 0)

    CHUNK = 64  # match granularity (chars): a trie at chunk level is enough for a model

    def _keys(self, text: str) -> list[str]:
        return [text[: i + self.CHUNK] for i in range(0, len(text) - self.CHUNK + 1, self.CHUNK)]

    def choose(self, text: str, load: dict[str, int], rng: random.Random, now: float) -> str:
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > self.abs_thr and hi > lo * self.rel_thr:
            return min(self.names, key=lambda n: (load[n], rng.random()))
        keys = self._keys(text)
        best, best_n = None, 0
        for n in self.names:
            t = self.trees[n]
            k = 0
            while k < len(keys) and keys[k] in t:
                k += 1
            if k > best_n or (k == best_n and best is not None and rng.random() < 0.5):
                best, best_n = n, k
        if best is not None and keys and best_n / len(keys) > self.cache_threshold:
            pick = best
        else:
            pick = min(self.names, key=lambda n: (self.size[n], rng.random()))
        t = self.trees[pick]
        for k in keys:
            if k not in t:
                self.size[pick] += self.CHUNK
            t[k] = now
        if self.size[pick] > self.max_chars:  # LRU eviction by chunk
            for k, _ in sorted(t.items(), key=lambda kv: kv[1])[: len(t) // 4]:
                del t[k]
                self.size[pick] -= self.CHUNK
        return pick


@dataclass
class _W:
    name: str
    engine: Engine
    busy: bool = False
    batch: Batch | None = None  # the batch in flight while busy
    batch_end: float = 0.0
    reports: list[KvReport] = field(default_factory=list)
    last_report_at: float = float("-inf")
    # why the batch in flight was formed with requests left waiting: "" (none left), "prefill"
    # (they queue behind it), "kv" / "slots" (decode: the queue's head could not be admitted)
    blocked: str = ""
    left_waiting: set[str] = field(default_factory=set)  # ids of the requests it left waiting
    transit: list[tuple[float, str, list[int], int]] = field(default_factory=list)  # routed, not landed


_PROBE = "__routesim_oracle_probe__"


def fork(engine: Engine, batch: Batch | None) -> tuple[Engine, Batch | None]:
    """An independent copy of `engine` (and of its batch in flight) to run forward: what
    `copy.deepcopy` gives, twenty times faster (prompts and cached token tuples are shared, never
    mutated), with a listener that hears nothing."""
    e = copy.copy(engine)
    e.listener = NullListener()
    pool = e.pool = copy.copy(engine.pool)
    pool.cached = {d: copy.copy(pg) for d, pg in engine.pool.cached.items()}
    pool._heap = list(engine.pool._heap)
    pool.events = []
    twin: dict[int, SimRequest] = {}

    def clone(r: SimRequest) -> SimRequest:
        c = twin.get(id(r))
        if c is None:
            c = twin[id(r)] = copy.copy(r)
            c.output_ids, c.chain = list(r.output_ids), list(r.chain)
            if r._outputs is not None:
                c._outputs = copy.copy(r._outputs)
                c._outputs._rng = random.Random()
                c._outputs._rng.setstate(r._outputs._rng.getstate())
        return c

    e.waiting = type(engine.waiting)(map(clone, engine.waiting))
    e.running = list(map(clone, engine.running))
    e.requests = {rid: clone(r) for rid, r in engine.requests.items()}
    b = None
    if batch is not None:
        b = copy.copy(batch)
        b.reqs = list(map(clone, batch.reqs))
    e._in_flight = b if engine._in_flight is not None else None
    return e, b


Arrival = tuple[float, str, list[int], int]  # (lands at, request id, prompt ids, max_tokens)


def forecast(w: _W, now: float, arrivals: list[Arrival]) -> dict[str, float]:
    """First-token times of every request on `w` that has none yet and of each of `arrivals` (in
    landing order) if nothing else arrived: a copy of the engine with its batch in flight is run
    forward, the arrivals submitted as routesim's event loop would, until all of them have one
    (the oracles' perfect information)."""
    engine, batch = fork(w.engine, w.batch if w.busy else None)
    t, end = now, (w.batch_end if batch is not None else None)
    todo = {r.rid for r in engine.requests.values() if r.first_token_time is None}
    todo.update(a[1] for a in arrivals)
    queue = deque(arrivals)
    eta: dict[str, float] = {}
    while todo:
        if end is None:
            batch = engine.schedule(t)
            if batch is None:
                if not queue:
                    raise RuntimeError("the engine went idle with requests queued")
                at, rid, ids, mx = queue.popleft()  # idle until it lands
                t = max(t, at)
                engine.submit(rid, ids, mx, t)
                batch = engine.schedule(t)
                assert batch is not None
            end = t + batch.duration
        while queue and queue[0][0] < end:  # lands while this batch runs
            at, rid, ids, mx = queue.popleft()
            engine.submit(rid, ids, mx, at)
        for out in engine.complete(batch, end):
            if out.index == 0 and out.rid in todo:
                todo.discard(out.rid)
                eta[out.rid] = end
        t, end = end, None
    return eta


def first_token_at(w: _W, now: float, net_s: float, ids: list[int], max_tokens: int) -> float:
    """When a request sent to `w` now would get its first token if nothing else arrived (`oracle`)."""
    return forecast(w, now, [*w.transit, (now + net_s, _PROBE, ids, max_tokens)])[_PROBE]


def marginal_delay(w: _W, now: float, net_s: float, ids: list[int], max_tokens: int) -> float:
    """How much a request sent to `w` now adds to the sum of first-token times there (its own
    wait plus the delay it causes every request there still before its first token), if nothing
    else arrived (`oracle_sum`)."""
    base = forecast(w, now, w.transit)
    eta = forecast(w, now, [*w.transit, (now + net_s, _PROBE, ids, max_tokens)])
    return (eta.pop(_PROBE) - now) + sum(eta[r] - base[r] for r in eta)


# Where a request's time to first token goes (simulated seconds; they sum to its TTFT):
PARTS = (
    "held",  # waiting in the router for a worker to free up (serve_app.admission)
    "net",  # router → engine and first token → client
    "in_flight_decode",  # arrived during a decode step (batches run to completion)
    "in_flight_prefill",  # arrived during another prefill batch
    "prefill_ahead",  # queued while prefill batches of requests ahead of it ran
    "kv_admission",  # queued while decode steps ran: the queue's head did not fit in free KV
    "slots",  # the same, for want of a running slot
    "own_prefill",  # its batch's launch cost + its own uncached tokens
    "cobatch",  # the other prompts prefilled in its batch
)


# perfect-information yardsticks: name → the figure they minimise over the workers (module docstring)
ORACLES: dict[str, Callable[[_W, float, float, list[int], int], float]] = {
    "oracle": first_token_at, "oracle_sum": marginal_delay}


@dataclass
class Result:
    policy: str
    rate: float
    requests: int
    ttft: list[float]
    e2e: list[float]
    cached: int
    prompt: int
    first_send: float
    last_end: float
    per_worker: dict[str, int]
    parts: list[dict[str, float]] = field(default_factory=list)  # per measured request, as `ttft`
    served_by: list[str] = field(default_factory=list)  # per measured request, as `ttft`
    paused: list[float] = field(default_factory=list)  # per measured request: its decode's time in others' prefills
    outputs: list[int] = field(default_factory=list)  # per measured request: tokens generated
    prefill_s: float = 0.0  # Σ prefill batch time over the workers (measured or not)
    paused_s: float = 0.0  # Σ over those batches of their time × requests decoding beside them
    believed: int = 0  # kvroute policies: Σ prompt blocks the ledger counted as cached where they went
    blocks: int = 0  # … of Σ router blocks of those prompts (believed / blocks vs cached / prompt)

    def summary(self) -> dict[str, float]:
        q = statistics.quantiles(self.ttft, n=100) if len(self.ttft) > 1 else [0.0] * 99
        return {
            "req/s": self.requests / max(1e-9, self.last_end - self.first_send),
            "ttft_p50_ms": q[49] * 1e3, "ttft_p99_ms": q[98] * 1e3,
            "e2e_p50_ms": statistics.median(self.e2e) * 1e3 if self.e2e else 0.0,
            "e2e_p99_ms": statistics.quantiles(self.e2e, n=100)[98] * 1e3 if len(self.e2e) > 1 else 0.0,
            "hit": self.cached / max(1, self.prompt),
            "spread": max(self.per_worker.values()) / max(1e-9, statistics.mean(self.per_worker.values())),
        }

    def breakdown(self, lo: float = 0.0, hi: float = 1.0) -> dict[str, float]:
        """Mean of each of `PARTS` (ms) over the measured requests whose TTFT rank is in [lo, hi)."""
        sel = _band(self.ttft, lo, hi)
        out = {k: statistics.mean(self.parts[i].get(k, 0.0) for i in sel) * 1e3 for k in PARTS}
        out["ttft"] = statistics.mean(self.ttft[i] for i in sel) * 1e3
        return out

    def decode_breakdown(self, lo: float = 0.0, hi: float = 1.0) -> dict[str, float]:
        """Means over the measured requests whose E2E rank is in [lo, hi): e2e, ttft, decode (ms;
        decode = e2e − ttft), of it `paused` (others' prefill batches run instead of its decode
        steps) and `steps` (the rest), and `outputs` (tokens)."""
        sel = _band(self.e2e, lo, hi)

        def mean(f: Callable[[int], float]) -> float:
            return statistics.mean(map(f, sel))
        return {"e2e": mean(self.e2e.__getitem__) * 1e3, "ttft": mean(self.ttft.__getitem__) * 1e3,
                "decode": mean(lambda i: self.e2e[i] - self.ttft[i]) * 1e3,
                "paused": mean(self.paused.__getitem__) * 1e3,
                "steps": mean(lambda i: self.e2e[i] - self.ttft[i] - self.paused[i]) * 1e3,
                "outputs": mean(self.outputs.__getitem__)}


def _band(values: list[float], lo: float, hi: float) -> list[int]:
    """Indices of `values` whose rank is in [lo, hi) (at least one)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[int(lo * len(order)):max(int(lo * len(order)) + 1, int(hi * len(order)))]


async def _no_aggregator() -> Any:
    raise RuntimeError("routesim feeds the follower by hand")


def run(workload: str, rate: float, duration_s: float, policy: str, *, seed: int = 1, workers: int = 4,
        knobs: Knobs | None = None, kv_aware: dict[str, Any] | None = None, warmup_s: float = 0.0,
        engine: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
        router: dict[str, Any] | None = None) -> Result:
    """Drive one trace through `workers` simulated engines routed by `policy`."""
    k = knobs or Knobs()
    eng = {**ENGINES.get(workload, ENGINE), **(engine or {})}
    cfg = EngineConfig(**{k: v for k, v in eng.items() if k != "time_scale"})
    now = 0.0
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()

    def at(t: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    ws: dict[str, _W] = {}
    for i in range(workers):
        w = _W(f"sim-{i}", None)  # type: ignore[arg-type]

        class _L:
            def __init__(self, w: _W) -> None:
                self.w = w

            def on_kv_metrics(self, report: KvReport) -> None:
                at(now + k.report_delay_s, "report", (self.w.name, report, now))

            def on_kv_events(self, events: list) -> None:
                pass

        w.engine = Engine(cfg, _L(w))
        ws[w.name] = w
    names = list(ws)
    clock: Callable[[], float] = lambda: now  # noqa: E731
    # kvroute's own decision plane, fed by hand instead of by the aggregator
    follower = FleetFollower(_no_aggregator)
    core = RouterCore(RouterConfig(policy="kv_aware" if policy in ("cache_aware", *ORACLES) else policy,
                                   kv_aware=kv_aware or {}, seed=seed, **(router or {})), follower, "sim", clock=clock)

    def update(name: str, metrics: dict[str, Any] | None, produced: float | None, state: str) -> None:
        follower.workers[name] = WorkerRecord(name=name, url=name, page_size=cfg.page_size, state=state,
                                              healthy=True, metrics=metrics, metrics_at=produced, heartbeat_at=now)
        core.on_fleet_update([name])

    for n in names:
        update(n, None, None, "idle")
    pol = CacheAwareModel(names) if policy == "cache_aware" else None
    rng = random.Random(seed)
    ca_load = dict.fromkeys(names, 0)

    trace = make_trace(workload, seed, rate, duration_s, **(PARAMS[workload] if params is None else params))
    replies: dict[str, list[str]] = {}
    info: dict[str, dict[str, Any]] = {}  # rid → bookkeeping
    res = Result(policy, rate, 0, [], [], 0, 0, float("inf"), 0.0, dict.fromkeys(names, 0))
    for s in trace.sessions:
        replies[s.sid] = []
        at(s.start_s, "arrive", (s, 0))

    def kick(w: _W) -> None:
        if w.busy:
            return
        batch = w.engine.schedule(now)
        if batch is not None:
            w.busy, w.batch, w.batch_end = True, batch, now + batch.duration
            e = w.engine
            w.blocked = "" if not e.waiting else "prefill" if batch.kind is BatchKind.PREFILL else \
                "slots" if len(e.running) >= e.config.max_running_requests else "kv"
            w.left_waiting = {q.rid for q in e.waiting}
            at(now + batch.duration, "complete", (w.name, batch))

    def account(w: _W, batch: Batch) -> None:
        """Charge the batch that just ended to the requests it kept waiting or prefilled (`PARTS`)."""
        for q in w.engine.waiting:
            if q.rid not in w.left_waiting:
                key, start = "in_flight_" + batch.kind.value, q.arrival
            else:
                key, start = ("prefill_ahead" if w.blocked == "prefill" else
                              "kv_admission" if w.blocked == "kv" else "slots"), batch.start
            parts = info[q.rid]["parts"]
            parts[key] = parts.get(key, 0.0) + now - start
        if batch.kind is BatchKind.PREFILL:
            res.prefill_s += batch.duration
            for q in w.engine.running:  # decoding: SGLang runs this prefill instead of their step
                if q not in batch.reqs and q.rid in info:
                    info[q.rid]["paused"] = info[q.rid].get("paused", 0.0) + batch.duration
                    res.paused_s += batch.duration
            for q in batch.reqs:
                own = cfg.prefill_base_s + (0 if q.prefilled else
                                            cfg.prefill_per_token_s * (len(q.input_ids) - q.cached_tokens))
                parts = info[q.rid]["parts"]
                parts["own_prefill"] = own
                parts["cobatch"] = batch.duration - own

    def state_of(n: str) -> str:
        return "live" if now - ws[n].last_report_at <= k.idle_after_s else "idle"

    adm = core.admission
    holds: dict[int, Callable[[], None]] = {}  # held (arrival event id) → what takes it out of the queue
    while events:
        now, _, kind, p = heapq.heappop(events)
        held_since = None
        if kind in ("held", "held_expired"):  # its turn came (a worker freed up), or max_wait_s passed
            key, held_since, p = p
            leave = holds.pop(key, None)
            if leave is None:
                continue  # already dispatched by the other of the two events
            leave()
            kind = "arrive"
        if kind == "arrive":
            s, turn = p
            msgs = build_messages(s, turn, replies[s.sid])
            body = {"model": "m", "messages": msgs, "max_tokens": s.turns[turn].max_tokens, "stream": True}
            rid = f"{s.sid}/{turn}"
            if policy in ORACLES:
                ids = tokenizer.apply_chat_template(msgs)
                eta = {n: ORACLES[policy](ws[n], now, k.net_s, ids, s.turns[turn].max_tokens) for n in names}
                first = min(eta.values())
                name = rng.choice([n for n in names if eta[n] <= first + 1e-9])
            elif pol is not None:
                text = "".join(m["content"] for m in msgs)
                name = pol.choose(text, ca_load, rng, now)
                ca_load[name] += 1
            else:
                for n in names:  # time-driven states (the aggregator's tick)
                    rec = follower.workers[n]
                    if rec.metrics is not None and rec.state != state_of(n):
                        update(n, rec.metrics, rec.metrics_at, state_of(n))
                facts = core.facts(body)
                if held_since is None and core.should_hold(facts, policy):  # serve_app.admission (streamed)
                    key = next(seq)

                    def wake(key: int = key, t0: float = now, p: Any = p) -> bool:
                        at(now, "held", (key, t0, p))  # `now`: when it is woken
                        return True
                    holds[key] = adm.enqueue(wake)
                    at(now + adm.config.max_wait_s, "held_expired", (key, now, p))
                    continue
                d, facts = core.decide(facts)
                name = d.worker
                if s.start_s >= warmup_s:  # what the ledger is charged (before on_routed records it)
                    ov = facts.overlap.get(name, 0)
                    res.believed += min(ov, core.prefix.held_blocks(name, facts.block_hashes)) if ov else 0
                    res.blocks += facts.prompt_blocks
                core.on_routed(rid, facts, name)
                if adm.config.enabled:
                    adm.dispatched(name)
                    core.wake_held()
            ids = tokenizer.apply_chat_template(msgs)
            measured = s.start_s >= warmup_s
            info[rid] = {"sent": now if held_since is None else held_since, "session": s, "turn": turn, "worker": name, "measured": measured,
                         "out": [], "n_prompt": len(ids), "parts": {"net": 2 * k.net_s}}
            if held_since is not None:
                info[rid]["parts"]["held"] = now - held_since
            res.per_worker[name] += 1
            if measured:
                res.first_send = min(res.first_send, now)
            ws[name].transit.append((now + k.net_s, rid, ids, s.turns[turn].max_tokens))
            at(now + k.net_s, "submit", (name, rid, ids, s.turns[turn].max_tokens))
        elif kind == "submit":
            name, rid, ids, mx = p
            ws[name].transit = [a for a in ws[name].transit if a[1] != rid]
            info[rid]["req"] = ws[name].engine.submit(rid, ids, mx, now)
            kick(ws[name])
        elif kind == "complete":
            name, batch = p
            w = ws[name]
            w.busy = False
            account(w, batch)
            for out in w.engine.complete(batch, now):
                r = info[out.rid]
                if out.token_id is not None:
                    r["out"].append(out.token_id)
                if out.index == 0 and "ttft" not in r:
                    r["ttft"] = now + k.net_s - r["sent"]
                    at(now + k.net_s, "first", out.rid)
                if out.finished:
                    at(now + k.net_s, "done", out.rid)
            kick(w)
        elif kind == "first":
            core.ledger.on_first_token(p)
            if pol is None and policy not in ORACLES and adm.config.enabled:
                adm.prefilled(info[p]["worker"])
        elif kind == "done":
            rid = p
            r = info.pop(rid)
            core.ledger.on_finished(rid)
            if pol is not None:
                ca_load[r["worker"]] -= 1
            req = r.get("req")
            s, turn = r["session"], r["turn"]
            replies[s.sid].append(tokenizer.decode(r["out"]).strip())
            if r["measured"]:
                res.requests += 1
                res.ttft.append(r.get("ttft", now - r["sent"]))
                res.parts.append(r["parts"])
                res.served_by.append(r["worker"])
                res.paused.append(r.get("paused", 0.0))
                res.outputs.append(len(r["out"]))
                res.e2e.append(now - r["sent"])
                res.last_end = max(res.last_end, now)
                res.prompt += r["n_prompt"]
                res.cached += req.cached_tokens if req is not None else 0
            if turn + 1 < len(s.turns):
                at(now + s.turns[turn + 1].gap_s, "arrive", (s, turn + 1))
        elif kind == "report":
            name, rep, produced = p
            ws[name].last_report_at = produced
            m = rep.as_dict()  # the worker actor converts token counts to pages
            m["kv_active_blocks"] = -(-m["kv_active_blocks"] // cfg.page_size)
            m["kv_total_blocks"] = -(-m["kv_total_blocks"] // cfg.page_size)
            update(name, m, produced + k.report_date_bias_s, "live")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=None, choices=sorted(PARAMS),
                    help="default: shared_prefix, or every workload of --suite")
    ap.add_argument("--suite", default=None, choices=sorted(SUITES),
                    help="each workload of this bench.run suite at its rates, with its engine and parameters")
    ap.add_argument("--rates", default=None, help="default: 12,24,30, or the suite's")
    ap.add_argument("--duration", type=float, default=60.0, help="arrival window, simulated seconds")
    ap.add_argument("--warmup", type=float, default=5.0, help="sessions starting earlier are not measured")
    ap.add_argument("--policies", default="kv_aware,cache_aware,round_robin,least_loaded",
                    help=f"kvroute policies, cache_aware (the model) or the yardsticks {', '.join(ORACLES)}")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--net", type=float, default=Knobs.net_s, metavar="S",
                    help="router → worker (and back) transit, simulated seconds; a starved router's dispatch lag")
    ap.add_argument("--report-date-bias", type=float, default=0.0, metavar="S",
                    help="the router dates each report this much later than it was produced")
    ap.add_argument("--report-delay", type=float, default=Knobs.report_delay_s, metavar="S",
                    help="engine report → router's view (the metrics plane's lag), simulated seconds")
    ap.add_argument("--kv", action="append", default=[], metavar="KNOB=VALUE",
                    help="a kv_aware knob for every kv_aware run, e.g. --kv tolerance=0.5")
    ap.add_argument("--router", action="append", default=[], metavar="SECTION.KEY=JSON",
                    help="a router setting for every run, e.g. --router prefix_index.cache_share=0")
    ap.add_argument("--breakdown", action="store_true",
                    help="then where the TTFT went (PARTS, ms) for the median band (p40-p60) and the tail (≥ p99)")
    ns = ap.parse_args()
    kv = {a.split("=", 1)[0]: float(a.split("=", 1)[1]) for a in ns.kv}
    router = parse_router_overrides(ns.router)
    cells: list[tuple[str, float, dict[str, Any] | None, dict[str, Any] | None]] = []
    if ns.suite:
        suite = SUITES[ns.suite]
        for wl, spec in suite["workloads"].items():
            if ns.workload in (None, wl):
                for rate in ([float(x) for x in ns.rates.split(",")] if ns.rates else spec["rates"]):
                    cells.append((wl, float(rate), spec["params"], suite["engine"]))
    else:
        wl = ns.workload or "shared_prefix"
        cells = [(wl, float(x), None, None) for x in (ns.rates or "12,24,30").split(",")]
    print(f"# routesim: {ns.suite + ' suite' if ns.suite else cells[0][0]}, {ns.duration:g} s window "
          f"(warm-up {ns.warmup:g} s), engine {cells[0][3] or ENGINES.get(cells[0][0], ENGINE)}, "
          f"kv_aware overrides {kv or 'none'}, router overrides {router or 'none'}\n")
    print("| policy | workload | rate | req/s | TTFT p50 ms | p99 ms | E2E p50 ms | p99 ms | hit % | spread |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    parts: list[str] = []
    decode: list[str] = []
    for wl, rate, params, engine in cells:
        for pol in ns.policies.split(","):
            t0 = time.perf_counter()
            res = [run(wl, rate, ns.duration, pol, seed=s + 1, kv_aware=kv, warmup_s=ns.warmup,
                       engine=engine, params=params, router=router,
                       knobs=Knobs(net_s=ns.net, report_delay_s=ns.report_delay,
                                   report_date_bias_s=ns.report_date_bias))
                   for s in range(ns.seeds)]
            rows = [r.summary() for r in res]
            m = {key: statistics.mean(r[key] for r in rows) for key in rows[0]}
            print(f"| {pol} | {wl} | {rate:g} | {m['req/s']:.1f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
                  f"{m['e2e_p50_ms']:.0f} | {m['e2e_p99_ms']:.0f} | {m['hit'] * 100:.0f} | {m['spread']:.2f} |"
                  f"  <!-- {time.perf_counter() - t0:.1f} s -->")
            for band, lo, hi in (("p40-p60", 0.4, 0.6), ("≥ p99", 0.99, 1.0)):
                b = [r.breakdown(lo, hi) for r in res]
                parts.append(f"| {pol} | {wl} | {rate:g} | {band} | {statistics.mean(x['ttft'] for x in b):.0f} | "
                             + " | ".join(f"{statistics.mean(x[k] for x in b):.0f}" for k in PARTS) + " |")
            for band, lo, hi in (("p40-p60", 0.4, 0.6), ("≥ p90", 0.9, 1.0), ("≥ p99", 0.99, 1.0)):
                d = [r.decode_breakdown(lo, hi) for r in res]
                decode.append(f"| {pol} | {wl} | {rate:g} | {band} | "
                              + " | ".join(f"{statistics.mean(x[k] for x in d):.0f}"
                                           for k in ("e2e", "ttft", "decode", "paused", "steps", "outputs"))
                              + (f" | {sum(r.paused_s for r in res) / max(1e-9, sum(r.prefill_s for r in res)):.2f} |"
                                 if band == "p40-p60" else " | |"))
            sys.stdout.flush()
    if ns.breakdown:
        print("\nWhere the time to first token went (mean ms over the requests of the band; `PARTS` in "
              "bench/routesim.py):\n")
        print("| policy | workload | rate | band | TTFT | " + " | ".join(PARTS) + " |")
        print("|---|---|---:|---|---:|" + "---:|" * len(PARTS))
        print("\n".join(parts))
        print("\nWhere the decode went (mean over the requests of the band by E2E rank; paused: others' prefill "
              "batches run instead of its decode steps; beside: requests decoding beside a prefill batch, "
              "time-weighted, every worker):\n")
        print("| policy | workload | rate | E2E band | E2E | TTFT | decode | paused | steps | outputs | beside |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        print("\n".join(decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
