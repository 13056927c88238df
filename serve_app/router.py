"""The decision plane of one router replica: fleet view + in-flight ledger + prefix index → policy.

No Serve and no HTTP here; `serve_app.app` is the thin HTTP shell around `RouterCore`.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from typing import Any, Callable

from actors.models import KV_METRICS_FIELDS
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.ledger import Ledger, refresh_fleet
from serve_app.policies import POLICIES, Decision, RouteRequest, WorkerView, get_policy
from serve_app.policies.base import NoWorkerAvailable
from serve_app.policies.kv_aware import KvAware
from serve_app.policies.fleet import FleetView
from serve_app.kv_follower import KvFollower
from serve_app.prefix_index import KvEventIndex, PrefixIndex
from serve_app.prompt_tokens import body_token_ids, load_tokenizer
from serve_app.request_facts import facts_from_body


# the columns of each candidate in a decision-log line (`RouterConfig.decision_log`)
DECISION_LOG_COLUMNS = ("state", "running", "waiting", "kv_active_blocks", "pending", "pending_prefill_blocks",
                        "pending_kv_blocks", "remote_pending", "in_flight", "hot_blocks", "reused_blocks",
                        "overlap", "metrics_age_s", "prefilling")


def base_view(rec: WorkerRecord, hot_blocks: int = 0, reused_blocks: int = 0) -> WorkerView:
    """A worker as its last report shows it, with the prefix index's hot (and of those, reused)
    blocks (the ledger adds its own figures on top)."""
    m = rec.metrics or {}
    return WorkerView(
        name=rec.name,
        url=rec.url,
        state=rec.state,
        page_size=rec.page_size,
        running=m.get("request_active_slots", 0),
        total_slots=m.get("request_total_slots", 0),
        waiting=m.get("num_requests_waiting", 0),
        kv_active_blocks=m.get("kv_active_blocks", 0),
        kv_total_blocks=m.get("kv_total_blocks", 0),
        hot_blocks=hot_blocks,
        reused_blocks=reused_blocks,
    )


class RouterCore:
    """Fleet view (from the follower) + ledger + prefix index → a policy's decision, all local."""

    def __init__(
        self,
        config: RouterConfig,
        follower: FleetFollower,
        replica_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.follower = follower
        self.replica_id = replica_id
        self.rng = random.Random(config.seed)
        self.ledger = Ledger(config.ledger, replica_id=replica_id, block_tokens=config.block_size, clock=clock)
        self.prefix = PrefixIndex(**config.prefix_index.approximate_kwargs(), clock=clock)
        self.exact = KvEventIndex(config.block_size, max_blocks_per_source=config.prefix_index.max_blocks_per_source)
        self.kv_follower: KvFollower | None = None  # set by the Serve shell (needs Ray handles)
        self.facts_config = config.facts_config()
        self.tokenizer = load_tokenizer(config.tokenizer)  # TokenizerError at start, not per request
        self.tokenize_failures = 0
        self.default_policy = config.policy
        get_policy(self.default_policy)  # unknown default → error at start, not per request
        self._policies = {name: get_policy(name) for name in POLICIES}
        self._policies["kv_aware"] = KvAware(config.kv_aware)
        self._base: dict[str, WorkerView] = {}
        self.fleet = FleetView()
        self._remote: dict[str, dict[str, int]] = {}  # other replica → {worker: pending}
        follower.on_update = self._on_fleet_update
        self._clock = clock
        # line-buffered: a diagnostic log must hold every decision up to the moment it is read
        self._dlog = open(config.decision_log, "a", buffering=1) if config.decision_log else None  # noqa: SIM115

    # --- fleet view ---------------------------------------------------------------------------

    def _on_fleet_update(self, changed: list[str]) -> None:
        touched: set[str] = set()
        for name in changed:
            rec = self.follower.workers.get(name)
            if rec is None:
                if self.kv_follower is not None:
                    self.kv_follower.drop(name)
                self._base.pop(name, None)
                self.fleet.remove(name)
                self.ledger.remove_worker(name)
                self.prefix.remove_worker(name)
                for counts in self._remote.values():
                    counts.pop(name, None)
                continue
            if rec.metrics_at is not None:
                self.ledger.on_report(name, rec.metrics_at)
            actor_name = rec.kv_events_actor
            # exact mode only when prompts are tokenized like the engine: text-hashed blocks
            # never match the engine's token blocks, so following would erase all affinity
            if actor_name and self.kv_follower is not None and self.config.tokenizer != "none":
                self.kv_follower.ensure(name, actor_name)
            base = base_view(rec, self.prefix.hot_blocks(name), self.prefix.reused_blocks(name))
            self._base[name] = base
            self.fleet.update(self.ledger.apply(base))
            for replica, counts in self._remote.items():
                if name in counts and replica not in rec.in_flight_by_replica:
                    del counts[name]
                    touched.add(replica)
            for replica, n in rec.in_flight_by_replica.items():
                if replica != self.replica_id and self._remote.setdefault(replica, {}).get(name) != n:
                    self._remote[replica][name] = n
                    touched.add(replica)
        for replica in touched:
            self.ledger.merge_remote(replica, self._remote[replica])

    def refresh_remote(self) -> None:
        """Re-date the other replicas' counts we still see in the snapshot (the aggregator expires
        dead replicas; the ledger would otherwise drop live ones that simply did not change)."""
        for replica, counts in list(self._remote.items()):
            if counts:
                self.ledger.merge_remote(replica, counts)
            else:
                del self._remote[replica]

    def views(self) -> FleetView:
        hot = self.prefix.take_changed()
        if hot:
            hot &= self._base.keys()
            for name in hot:
                self._base[name] = replace(self._base[name], hot_blocks=self.prefix.hot_blocks(name),
                                           reused_blocks=self.prefix.reused_blocks(name))
        refresh_fleet(self.fleet, self._base, self.ledger, also=hot)
        return self.fleet

    # --- decisions ----------------------------------------------------------------------------

    def facts(self, body: Any) -> RouteRequest:
        """Routing facts of an OpenAI/SGLang body. Raises InvalidRequestBody (→ 400)."""
        ids = None
        if self.tokenizer is not None:
            ids = body_token_ids(self.tokenizer, body)
            if ids is None and _has_text_prompt(body):
                # the template refused this body (or it is malformed): approximate for this one
                self.tokenize_failures += 1
        return facts_from_body(body, config=self.facts_config, token_ids=ids)

    def policy(self, name: str | None) -> Any:
        name = name or self.default_policy
        p = self._policies.get(name)
        if p is None:
            get_policy(name)  # raises UnknownPolicy listing the valid names
        return p

    def decide(
        self, request: RouteRequest, policy_name: str | None = None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> tuple[Decision, RouteRequest]:
        """Pick a worker (never one in `exclude`, e.g. already failed for this request). Returns
        the decision and the request with the prefix overlap it was decided on — pass that one to
        `on_routed`, so the ledger charges only the blocks the worker must still prefill."""
        policy = self.policy(policy_name)
        if request.block_hashes:
            overlap = self.prefix.overlap(request.block_hashes)
            synced = self.kv_follower.synced if self.kv_follower is not None else ()
            if synced:  # exact mode: what the engine reports it holds beats what we sent it
                exact = self.exact.overlap(request.block_hashes)
                for w in synced:
                    overlap[w] = exact.get(w, 0)
            request = request.with_overlap(overlap)
        fleet = self.views()
        workers = fleet if not exclude else [v for v in fleet if v.name not in exclude]
        if exclude and not workers and len(fleet):
            raise NoWorkerAvailable(f"no routable worker: all {len(fleet)} are excluded for this request "
                                    f"(already tried, or circuit breaker open)")
        decision = policy.choose(request, workers, self.rng)
        if self._dlog is not None:
            self._log_decision(request, decision, workers)
        return decision, request

    def _log_decision(self, request: RouteRequest, decision: Decision, workers: Any) -> None:
        now = self._clock()
        recs = self.follower.workers
        cand = {}
        for v in workers:
            rec = recs.get(v.name)
            age = None if rec is None or rec.metrics_at is None else round(now - rec.metrics_at, 4)
            cand[v.name] = [v.state, v.running, v.waiting, v.kv_active_blocks, v.pending,
                            v.pending_prefill_blocks, v.pending_kv_blocks, v.remote_pending, v.in_flight,
                            v.hot_blocks, v.reused_blocks, request.overlap.get(v.name, 0), age, v.prefilling]
        self._dlog.write(json.dumps({"t": round(now, 4), "worker": decision.worker, "reason": decision.reason,
                                     "prompt_blocks": request.prompt_blocks, "w": cand}) + "\n")

    def on_routed(self, request_id: str, request: RouteRequest, worker: str) -> None:
        """The request is being sent to `worker`: count it in flight and index its prompt there
        (now, not when the worker answers: a long prefill would otherwise let the next requests
        with the same prefix miss it). A failed attempt leaves a stale entry that ages out."""
        self.ledger.on_routed(request_id, worker, request.prompt_blocks, request.overlap.get(worker, 0))
        if request.block_hashes:
            self.prefix.record(worker, request.block_hashes)

    # --- public views -------------------------------------------------------------------------

    def workers_json(self) -> dict[str, Any]:
        now = time.monotonic()
        workers = []
        for rec in sorted(self.follower.workers.values(), key=lambda r: r.name):
            lv = self.ledger.view(rec.name, idle=rec.state == "idle")
            workers.append(
                {
                    "name": rec.name,
                    "url": rec.url,
                    "state": rec.state,
                    "healthy": rec.healthy,
                    "health_detail": rec.health_detail,
                    "page_size": rec.page_size,
                    "metrics_age_s": None if rec.metrics_at is None else round(now - rec.metrics_at, 4),
                    "heartbeat_age_s": round(now - rec.heartbeat_at, 4),
                    "metrics": {f: rec.metrics[f] for f in KV_METRICS_FIELDS} if rec.metrics else None,
                    "ranks": rec.ranks,
                    "in_flight": lv.in_flight + lv.remote_pending,
                    "in_flight_local": lv.in_flight,
                    "updated_at": rec.updated_at,
                    "managed": rec.managed_view(),
                }
            )
        return {"version": self.follower.version, "epoch": self.follower.epoch, "workers": workers}

    def healthz(self) -> dict[str, Any]:
        f = self.follower
        age = f.snapshot_age_s()
        states: dict[str, int] = {}
        for rec in f.workers.values():
            states[rec.state] = states.get(rec.state, 0) + 1
        routable = states.get("live", 0) + states.get("idle", 0)
        status = "ok" if f.connected and routable else ("degraded" if routable else "unavailable")
        return {
            "status": status,
            "aggregator": "reachable" if f.connected else "unreachable",
            "aggregator_error": f.last_error,
            "snapshot_age_s": None if age is None else round(age, 3),
            "snapshot_version": f.version,
            "workers": states,
            "replica": self.replica_id,
            "default_policy": self.default_policy,
        }


def _has_text_prompt(body: Any) -> bool:
    return isinstance(body, dict) and (
        isinstance(body.get("messages"), list) or any(isinstance(body.get(k), str) for k in ("prompt", "text"))
    )
