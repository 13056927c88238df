"""The decision plane of one router replica: fleet view + in-flight ledger + prefix index → policy.

No Serve and no HTTP here; `serve_app.app` is the thin HTTP shell around `RouterCore`.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Iterable

from actors.models import KV_METRICS_FIELDS
from serve_app.admission import Admission
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower, WorkerRecord
from serve_app.ledger import Ledger, refresh_fleet
from serve_app.policies import POLICIES, Decision, RouteRequest, WorkerView, get_policy
from serve_app.policies.base import NoWorkerAvailable, target_name
from serve_app.policies.kv_aware import KvAware, worker_terms
from serve_app.policies.fleet import FleetView
from serve_app.kv_follower import KvFollower
from serve_app.prefix_index import KvEventIndex, PrefixIndex, namespace_salt
from serve_app.prediction import PredictionCheck
from serve_app.prompt_tokens import body_token_ids, load_tokenizer
from serve_app.request_facts import facts_from_body


# the columns of each candidate in a decision-log line (`RouterConfig.decision_log`)
DECISION_LOG_COLUMNS = ("state", "running", "waiting", "kv_active_blocks", "pending", "pending_prefill_blocks",
                        "pending_kv_blocks", "remote_pending", "in_flight", "hot_blocks", "reused_blocks",
                        "overlap", "metrics_age_s", "prefilling")


class UnknownModel(LookupError):
    """The request names a model no worker of the fleet serves (→ OpenAI's 404 model_not_found)."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"the model {model!r} does not exist in this fleet; served: {', '.join(served)}")
        self.model = model
        self.served = served


class ModelRequired(ValueError):
    """A request without `model` on a fleet that serves several (→ 400)."""


def request_adapter(body: Any) -> str | None:
    """The LoRA adapter a body's `lora_path` names (a list — a batch —: its first named entry; the
    model's `base:adapter` form, which SGLang prefers, is read by `RouterCore.resolve`)."""
    lp = body.get("lora_path") if isinstance(body, dict) else None
    if isinstance(lp, list):
        lp = next((a for a in lp if isinstance(a, str) and a), None)
    return lp if isinstance(lp, str) and lp else None


def base_view(rec: WorkerRecord, hot_blocks: int = 0, reused_blocks: int = 0, rank: int | None = None,
              metrics: dict[str, Any] | None = None) -> WorkerView:
    """A worker (or, `rank` given, one attention-DP rank of it with that rank's `metrics`) as its last
    report shows it, with the prefix index's hot (and of those, reused) blocks (the ledger adds its
    own figures on top)."""
    m = (rec.metrics if rank is None else metrics) or {}
    return WorkerView(
        name=target_name(rec.name, rank),
        worker="" if rank is None else rec.name,
        rank=rank,
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
        kv_follower: Callable[[KvEventIndex], KvFollower] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`kv_follower` builds the KV-event follower around this core's exact index (it needs Ray
        handles, so the Serve shell passes it; without one, prefix overlap is the approximate index's)."""
        self.config = config
        self.follower = follower
        self.replica_id = replica_id
        self.rng = random.Random(config.seed)
        self.ledger = Ledger(config.ledger, replica_id=replica_id, block_tokens=config.block_size, clock=clock)
        self.prefix = PrefixIndex(**config.prefix_index.approximate_kwargs(), clock=clock)
        self.admission = Admission(config.admission, clock=clock)
        self.exact = KvEventIndex(config.block_size, max_blocks_per_source=config.prefix_index.max_blocks_per_source,
                                  holder_of=self._holder_of)
        self.kv_follower: KvFollower | None = kv_follower(self.exact) if kv_follower is not None else None
        self.facts_config = config.facts_config()
        self.tokenizer = load_tokenizer(config.tokenizer)  # TokenizerError at start, not per request
        self.tokenize_failures = 0
        self.default_policy = config.policy
        get_policy(self.default_policy)  # unknown default → error at start, not per request
        self._policies = {name: get_policy(name) for name in POLICIES}
        self._policies["kv_aware"] = KvAware(config.kv_aware)
        # (model, PD role, name) → that group's own instance (see `_group_policy`)
        self._group_policies: dict[tuple[str | None, str | None, str], Any] = {}
        self._base: dict[str, WorkerView] = {}  # routing target (a worker, or a DP rank of one) → view
        # worker → its routing targets: (name,) without DP ranks, else one `target_name` per rank
        self._targets: dict[str, tuple[str, ...]] = {}
        # per model: which workers serve it (a worker may serve several names: aliases)
        self._served: dict[str, tuple[str, ...]] = {}  # worker → its model names (absent: unknown)
        self._by_model: dict[str, set[str]] = {}  # model name → workers declaring it
        self._agnostic: set[str] = set()  # workers that declare no model: candidates for any
        # LoRA: worker → the adapters it has loaded now (its /v1/models entries with a parent), and
        # every adapter it was seen with (SGLang loads an unloaded adapter again when a request names it)
        self._adapters: dict[str, frozenset[str]] = {}
        self._adapters_ever: dict[str, set[str]] = {}
        self._adapter_roots: dict[str, str] = {}  # adapter name → its path (`root` in /v1/models)
        self.predictions = PredictionCheck(config.prediction_check.check_config())
        # model name → the name its prefix-index keys are salted with: one per alias class (names some
        # worker declares together are one model); None: recomputed at the next use (`_alias_roots`)
        self._key_names: dict[str, str] | None = {}
        self._key_classes = 0  # how many distinct models (alias classes) the fleet declares
        self._roles: dict[str, tuple[str, int | None]] = {}  # PD role workers → (role, bootstrap port)
        self.fleet = FleetView()
        # per model group (a declared name; None: undeclared names → the model-agnostic workers): the
        # workers a request may go to and their own FleetView (None: the whole fleet), kept in step
        # with `fleet` by `_update_view`; rebuilt lazily after membership or models change
        self._model_fleets: dict[Any, tuple[frozenset[str], FleetView | None]] = {}
        self._view_sink = SimpleNamespace(update=self._update_view)  # what `refresh_fleet` updates
        follower.on_update = self.on_fleet_update
        self._clock = clock
        self._peer_counts_at = float("-inf")
        self._request_ids = itertools.count()
        self._last_keys: tuple[tuple[int, ...], str | None, tuple[int, ...]] = ((), None, ())  # `_prefix_keys`'
        # line-buffered: a diagnostic log must hold every decision up to the moment it is read
        self._dlog = open(config.decision_log, "a", buffering=1) if config.decision_log else None  # noqa: SIM115

    # --- fleet view ---------------------------------------------------------------------------

    def on_fleet_update(self, changed: list[str]) -> None:
        """Apply the follower's records of the `changed` workers (a worker absent from
        `follower.workers` left the fleet): fleet view, ledger, prefix index, other replicas' counts."""
        for name in changed:
            rec = self.follower.workers.get(name)
            if rec is not None and rec.in_flight_by_replica:
                by = rec.in_flight_by_replica
                if len(by) > 1 or self.replica_id not in by:
                    self._peer_counts_at = self._clock()  # another replica has requests in flight (`peers`)
            targets = None if rec is None else _targets_of(rec)
            old = self._targets.get(name)
            if self._index_models(name, tuple(rec.models) if rec is not None else None) or old != targets:
                self._model_fleets.clear()
            if self._index_adapters(name, rec):
                self._model_fleets.clear()
            role = (rec.role, rec.bootstrap_port) if rec is not None and rec.role != "both" else None
            if self._roles.get(name) != role:
                if role is None:
                    self._roles.pop(name, None)
                else:
                    self._roles[name] = role
                self._model_fleets.clear()
            if rec is None and self.kv_follower is not None:
                self.kv_follower.drop(name)
            for gone in old or ():  # left the fleet, or its ranks changed
                if targets is None or gone not in targets:
                    self._drop_target(gone)
                    self.admission.forget(gone)
            if targets is not None and self.admission.waiting:  # new targets: held requests may go there
                self.admission.release(len(targets) - len(set(targets) & set(old or ())))
            if rec is None:
                self._targets.pop(name, None)
                continue
            self._targets[name] = targets
            actor_name = rec.kv_events_actor
            # exact mode only when prompts are tokenized like the engine: text-hashed blocks
            # never match the engine's token blocks, so following would erase all affinity
            if actor_name and self.kv_follower is not None and self.config.tokenizer != "none":
                self.kv_follower.ensure(name, actor_name)
            if rec.dp_size <= 1:
                if rec.metrics_at is not None:
                    self.ledger.on_report(name, rec.metrics_at)
                base = base_view(rec, self.prefix.hot_blocks(name), self.prefix.reused_blocks(name))
                self._base[name] = base
                self._set_capacity(base)
                self._update_view(self.ledger.apply(base))
                self.ledger.set_remote(name, rec.in_flight_by_replica)
                continue
            # a DP worker: each rank its own target, from its own report (a rank not heard yet: zeros);
            # other replicas share their counts per worker, spread here evenly over the ranks
            by_rank = {r.get("data_parallel_rank", 0): r for r in rec.ranks}
            n = rec.dp_size
            for rank, target in enumerate(targets):
                at = rec.rank_at.get(rank)
                if at is not None:
                    self.ledger.on_report(target, at)
                base = base_view(rec, self.prefix.hot_blocks(target), self.prefix.reused_blocks(target), rank,
                                 by_rank.get(rank))
                self._base[target] = base
                self._set_capacity(base)
                self._update_view(self.ledger.apply(base))
                self.ledger.set_remote(target, {rep: c // n + (rank < c % n) for rep, c in rec.in_flight_by_replica.items()
                                                if c // n + (rank < c % n)})

    def _set_capacity(self, view: WorkerView) -> None:
        """The approximate index's idea of how much of `view`'s prefixes its cache keeps: the share
        `prefix_index.cache_share` of its reported KV pool, in router blocks (unknown before its
        first report)."""
        tokens = view.kv_total_blocks * view.page_size
        share = self.config.prefix_index.cache_share
        self.prefix.set_capacity(view.name, int(tokens * share) // self.config.block_size if tokens and share else None)

    def _drop_target(self, target: str) -> None:
        self._base.pop(target, None)
        self.fleet.remove(target)
        self.ledger.remove_worker(target)
        self.prefix.remove_worker(target)
        self.ledger.set_remote(target, {})

    def _holder_of(self, worker: str, rank: int) -> str:
        """The routing target whose cache a KV event of `worker`'s `rank` describes."""
        targets = self._targets.get(worker)
        return targets[rank] if targets is not None and len(targets) > 1 and rank < len(targets) else worker

    def targets(self, worker: str) -> tuple[str, ...]:
        """`worker`'s routing targets: itself, or one per attention-DP rank."""
        return self._targets.get(worker, (worker,))

    def in_flight(self, worker: str) -> int:
        """This replica's requests in flight on `worker` (all its ranks)."""
        return sum(self.ledger.in_flight(t) for t in self.targets(worker))

    def _update_view(self, view: WorkerView) -> None:
        """Put `view` into the fleet view and into the model groups' views that hold it."""
        self.fleet.update(view)
        worker = view.worker or view.name
        for names, fleet in self._model_fleets.values():
            if fleet is not None and worker in names:
                fleet.update(view)

    def _index_models(self, worker: str, models: tuple[str, ...] | None) -> bool:
        """Index `worker`'s model names (None: it left the fleet; (): it declares none). True if
        anything changed."""
        agnostic = worker in self._agnostic
        gone = models is None
        if models:
            self._agnostic.discard(worker)
        elif models is None:
            self._agnostic.discard(worker)
            models = ()
        else:
            self._agnostic.add(worker)
        old = self._served.get(worker, ())
        if old == models:
            return gone or agnostic != (worker in self._agnostic)
        for m in old:
            ws = self._by_model.get(m)
            if ws is not None:
                ws.discard(worker)
                if not ws:
                    del self._by_model[m]
        for m in models:
            self._by_model.setdefault(m, set()).add(worker)
        self._key_names = None
        if models:
            self._served[worker] = models
        else:
            self._served.pop(worker, None)
        return True

    def _index_adapters(self, worker: str, rec: WorkerRecord | None) -> bool:
        """Index `worker`'s loaded LoRA adapters (None: it left). True if they changed."""
        if rec is None:
            self._adapters_ever.pop(worker, None)
            self.predictions.remove_worker(worker)
            return self._adapters.pop(worker, None) is not None
        names = frozenset(a.name for a in rec.adapters)
        if self._adapters.get(worker, frozenset()) == names:
            return False
        self._adapters[worker] = names
        self._adapters_ever.setdefault(worker, set()).update(names)
        for a in rec.adapters:
            self._adapter_roots[a.name] = a.path
        return True

    def adapters(self, model: str | None = None) -> dict[str, tuple[str, int]]:
        """The LoRA adapters loaded on the workers of `model` (None: any): name → (path, workers)."""
        workers = self.serving(model) if model is not None else self._adapters.keys()
        out: dict[str, int] = {}
        for w in workers:
            for a in self._adapters.get(w, ()):
                out[a] = out.get(a, 0) + 1
        return {a: (self._adapter_roots.get(a, a), n) for a, n in sorted(out.items())}

    def served_models(self) -> list[str]:
        """Every model name the fleet serves (aliases included), sorted."""
        return sorted(self._by_model)

    def resolve_model(self, name: str | None) -> str | None:
        """The model a request is routed for: `name` if some worker serves it; with no name, the
        fleet's only model (every worker that declares models declares the same ones). None when
        no worker declares a model (a model-agnostic fleet: every worker may take every request).
        A worker that declares no model (no `model`/`served_model_names`, and its /v1/models gave
        none) is model-agnostic: a candidate for every name, so an undeclared name goes to those.
        Raises UnknownModel (nobody serves `name`), ModelRequired (no name, several models)."""
        if not self._by_model:
            return None
        if name is None:
            groups = set(self._served.values())
            if len(groups) == 1:
                return next(iter(groups))[0]
            raise ModelRequired(f"this fleet serves several models, name one in `model`: "
                                f"{', '.join(self.served_models())}")
        if name in self._by_model or self._agnostic:
            return name
        if not self.config.strict_models:
            only = self._only_model()
            if only is not None:  # as SGLang, which never checks a chat/completion's `model`
                return only
            for m in sorted(self._by_model):  # SGLang serves an adapter's bare name with its base model
                if name in self.adapters(m):
                    return m
        raise UnknownModel(name, self.served_models())

    def _only_model(self) -> str | None:
        """The fleet's one model (its least declared name) when every declared name is one model (its
        aliases: names some worker declares together), else None."""
        names = self._key_names
        if names is None:
            names = self._key_names = _alias_roots(self._served.values())
            self._key_classes = len(set(names.values()))
        return min(names) if self._key_classes == 1 else None

    def resolve(self, name: str | None, body: Any = None) -> tuple[str | None, str | None]:
        """The (model, LoRA adapter) a request is routed for. `model: "<base>:<adapter>"` is SGLang's
        LoRA form (`serving_base._parse_model_parameter`: a served name followed by ":" is cut off
        whole, else the name splits at its first ":"), and beats the body's `lora_path`; a name some
        worker declares whole (colons and all) is a model. The base part is a model name like any
        other (`resolve_model`: a single-model fleet takes any). Raises what `resolve_model` does."""
        adapter = None
        if name is not None and ":" in name and name not in self._by_model:
            base = next((m for m in sorted(self._by_model, key=len, reverse=True) if name.startswith(m + ":")), None)
            rest = name[len(base) + 1:] if base is not None else name.split(":", 1)[1]
            if base is None:
                base = name.split(":", 1)[0].strip()
            adapter = rest.strip() or None
            name = base
        model = self.resolve_model(name)
        return model, adapter if adapter is not None else request_adapter(body)

    def metric_model(self, model: str | None) -> str:
        """The `model` label of a request's metrics: its model when some worker declares it, else ""
        (a label never takes a client's arbitrary name: an undeclared name only model-agnostic
        workers take is routed, but not counted under its own name)."""
        return model if model is not None and model in self._by_model else ""

    def serving(self, model: str) -> set[str]:
        """The workers a request for `model` may go to: those declaring it and the model-agnostic ones."""
        declared = self._by_model.get(model)
        if declared is None:
            return set(self._agnostic)
        return declared | self._agnostic if self._agnostic else declared

    def declaring(self, model: str) -> int:
        """How many workers declare `model`."""
        return len(self._by_model.get(model, ()))

    def _prefix_keys(self, block_hashes: tuple[int, ...], model: str | None,
                     adapter: str | None = None) -> tuple[int, ...]:
        """The approximate index's keys of a prompt's blocks: (model, block) when the fleet serves
        several models, so a prefix sent to a model-B worker never attracts a model-A request, and
        (adapter, block) for a LoRA request — SGLang's radix cache keeps each adapter's KV apart
        (`Req.extra_key` += lora_id), so two adapters sharing a system prompt share no cache. A
        model's aliases (names a worker declares together) share one key: a prefix sent as `B` is
        in the cache a `b-alias` request reaches."""
        if not block_hashes:
            return block_hashes
        salt = namespace_salt(adapter)
        if model is not None and len(self._by_model) >= 2:
            names = self._key_names
            if names is None:
                names = self._key_names = _alias_roots(self._served.values())
                self._key_classes = len(set(names.values()))
            if self._key_classes >= 2:  # (one model under several names: its aliases share its entries)
                salt ^= hash(("kvroute-model", names.get(model, model)))
        if not salt:
            return block_hashes
        last = self._last_keys  # (a request's decision and its booking ask for the same keys)
        if last[0] is block_hashes and last[1] == salt:
            return last[2]
        keys = tuple(map(salt.__xor__, block_hashes))  # (C loop: every block of every request)
        self._last_keys = (block_hashes, salt, keys)
        return keys

    def refresh_remote(self) -> None:
        """Re-date the other replicas' counts we still see in the snapshot (the aggregator expires
        dead replicas; the ledger would otherwise drop live ones that simply did not change)."""
        self.ledger.refresh_remote()

    def in_flight_share(self) -> dict[str, int]:
        """What this replica tells the others, per share interval: its pending counts per worker
        (only non-zero ones). Also re-dates the other replicas' counts the snapshot still shows."""
        self.ledger.refresh_remote()
        return self.ledger.export()

    def peers(self, active_within_s: float) -> tuple[bool, bool]:
        """(another router replica shares its in-flight counts — the aggregator's deltas name it —,
        one showed requests in flight on some worker within the last `active_within_s`). A present
        but idle peer needs this replica's counts only once it routes, and then it shows its own."""
        replicas = self.follower.replicas
        present = len(replicas) > 1 or (len(replicas) == 1 and self.replica_id not in replicas)
        return present, present and self._clock() - self._peer_counts_at <= active_within_s

    def views(self) -> FleetView:
        hot = self.prefix.take_changed()
        if hot:
            hot &= self._base.keys()
            for name in hot:
                self._base[name] = replace(self._base[name], hot_blocks=self.prefix.hot_blocks(name),
                                           reused_blocks=self.prefix.reused_blocks(name))
        refresh_fleet(self._view_sink, self._base, self.ledger, also=hot)  # type: ignore[arg-type]
        return self.fleet

    def _model_group(self, model: str | None, role: str | None = None,
                     adapter: str | None = None) -> tuple[frozenset[str], FleetView]:
        """The workers a request for `model` (None: any model) may go to — with `role`, only those of
        that PD role; with a LoRA `adapter`, only those that have it loaded (else those that had it:
        SGLang loads an unloaded adapter again on use; else all of the model's, and the engine gives
        its own answer — SGLang's 400 for an adapter it never loaded, or the reply, if it has loaded
        it since its last /v1/models) — and the fleet view of just them (call after `views()`; the
        whole fleet's view when they are all of it)."""
        group = ("*" if model is None else model if model in self._by_model else None, role, adapter)
        hit = self._model_fleets.get(group)
        if hit is None:
            names = frozenset({v.worker or v.name for v in self.fleet} if model is None else self.serving(model))
            if role is not None:
                names = frozenset(n for n in names if self._roles.get(n, ("both",))[0] == role)
            if adapter is not None:
                names = frozenset(n for n in names if adapter in self._adapters.get(n, ())) \
                    or frozenset(n for n in names if adapter in self._adapters_ever.get(n, ())) or names
            whole = all((v.worker or v.name) in names for v in self.fleet)
            hit = self._model_fleets[group] = (names, None if whole else
                                               FleetView([v for v in self.fleet if (v.worker or v.name) in names]))
        return hit[0], hit[1] if hit[1] is not None else self.fleet

    def disaggregated(self, model: str | None) -> bool:
        """Whether requests for `model` (a `resolve_model` answer; None: any) go to a prefill + decode
        pair: some worker that may serve it has a PD role (docs/pd.md)."""
        if not self._roles:
            return False
        if model is None:
            return True
        return not self.serving(model).isdisjoint(self._roles)

    def bootstrap_port(self, worker: str) -> int | None:
        """A prefill worker's --disaggregation-bootstrap-port (None: not a prefill worker)."""
        role = self._roles.get(worker)
        return role[1] if role is not None and role[0] == "prefill" else None

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

    def _group_policy(self, name: str | None, model: str | None, role: str | None,
                      adapter: str | None = None) -> Any:
        """The policy instance for one group of workers — a model's, a PD side's: each keeps its own
        (a round_robin cycle shared by both PD sides would pair the same workers for ever, and one
        shared by two models' requests arriving in turn would send each model's requests to the
        same worker of it; sglang-router keeps one per side, and one router per model)."""
        policy = self.policy(name)
        key = (model, role, policy.name, adapter)
        p = self._group_policies.get(key)
        if p is None:
            p = self._group_policies[key] = KvAware(self.config.kv_aware) if policy.name == "kv_aware" \
                else get_policy(policy.name)
        return p

    def decide(
        self, request: RouteRequest, policy_name: str | None = None, exclude: set[str] | frozenset[str] = frozenset(),
        model: str | None = None, role: str | None = None, adapter: str | None = None,
        receipt: dict[str, Any] | None = None,
    ) -> tuple[Decision, RouteRequest]:
        """Pick a worker serving `model` (a `resolve_model` answer; None: any worker) — with `role`
        (prefill | decode), only among the workers of that PD role — never one in `exclude` (e.g.
        already failed for this request). Returns the decision and the request with the prefix
        overlap it was decided on — pass that one to `on_routed`, so the ledger charges only the
        blocks the worker must still prefill. `adapter`: a LoRA adapter (`resolve`): only workers
        with it loaded, prefix affinity in its own cache namespace. `receipt` (a dict, only when asked:
        `x-kvroute-explain`) is filled with every candidate's cost terms, overlap and input ages as the
        decision saw them (`_receipt`); without one nothing more is computed."""
        policy = self.policy(policy_name) if model is None and role is None and adapter is None \
            else self._group_policy(policy_name, model, role, adapter)
        if request.block_hashes:
            request = request.with_overlap(self._overlap(request.block_hashes, model, adapter))
        fleet = self.views()
        if model is not None or role is not None or adapter is not None:  # the policy sees just those workers
            serving, fleet = self._model_group(model, role, adapter)
            if not serving or (exclude and serving <= exclude):
                what = f"{role} worker" if role else "worker"
                raise NoWorkerAvailable(
                    f"no routable {what}" + (f" for model {model!r}" if model is not None else "") + ": " + (
                        f"all {len(serving)} are excluded for this request (already tried, or circuit "
                        f"breaker open)" if serving else f"no {what} serves it"
                        + (" (a disaggregated fleet needs role: prefill and role: decode workers)" if role else "")))
        if not exclude:
            decision = policy.choose(request, fleet, self.rng)
        else:
            # excluded workers are shown to the policy as down for this one decision: the fleet
            # view keeps its cached columns (a copy of a large fleet would cost O(workers))
            known = [v for w in exclude for v in map(fleet.get, self.targets(w)) if v is not None]
            if known and len(known) == len(fleet):
                raise NoWorkerAvailable(f"no routable worker: all {len(fleet)} are excluded for this request "
                                        f"(already tried, or circuit breaker open)")
            hidden = [v for v in known if v.state != "down"]
            for v in hidden:
                fleet.update(replace(v, state="down"))
            try:
                decision = policy.choose(request, fleet, self.rng)
            finally:
                for v in hidden:
                    fleet.update(v)
        if receipt is not None:
            receipt.update(self._receipt(request, decision, policy, fleet, exclude, model, adapter))
        if self._dlog is not None:
            self._log_decision(request, decision,
                               [v for v in fleet if (v.worker or v.name) not in exclude] if exclude else fleet)
        return decision, request

    def _receipt(self, request: RouteRequest, decision: Decision, policy: Any, fleet: Any,
                 exclude: set[str] | frozenset[str], model: str | None, adapter: str | None) -> dict[str, Any]:
        """A route receipt: the decision, and per candidate (every target the policy saw) its state,
        predicted overlap (and whether it is the engine's own, exact mode), the kv_aware cost with its
        request-independent terms, its load as the router saw it, and the age of each input: the
        worker's last KvMetrics report, the last KV-event answer applied (exact mode) and the other
        replicas' in-flight shares (None: not used for it)."""
        now, wall = self._clock(), time.time()
        P = request.prompt_blocks
        costs: dict[str, float] = {}
        if isinstance(policy, KvAware) and len(fleet):
            costs = policy.costs(request, fleet)
        applied = self.kv_follower.applied_at if self.kv_follower is not None else {}
        cands = []
        for v in fleet:
            worker = v.worker or v.name
            rec = self.follower.workers.get(worker)
            o = min(request.overlap.get(v.name, 0), P) if request.overlap else 0
            c: dict[str, Any] = {
                "target": v.name, "worker": worker, "rank": v.rank, "state": v.state,
                "excluded": worker in exclude, "overlap_blocks": o, "new_blocks": P - o,
                "overlap_source": "kv_events" if self._exact_for(v.name) else "approximate",
                "cost": None if v.name not in costs else round(costs[v.name], 3),
                "load": {"running": v.running, "waiting": v.waiting, "kv_active_blocks": v.kv_active_blocks,
                         "kv_total_blocks": v.kv_total_blocks, "in_flight": v.in_flight, "pending": v.pending,
                         "pending_prefill_blocks": v.pending_prefill_blocks, "pending_kv_blocks": v.pending_kv_blocks,
                         "remote_pending": v.remote_pending, "prefilling": v.prefilling,
                         "hot_blocks": v.hot_blocks, "reused_blocks": v.reused_blocks},
                "ages_s": {
                    "metrics": None if rec is None or rec.metrics_at is None else round(now - rec.metrics_at, 4),
                    "kv_events": round(time.monotonic() - applied[worker], 4) if worker in applied else None,
                    "in_flight_share": round(wall - rec.updated_at, 4) if rec is not None and rec.in_flight_by_replica
                    else None,
                },
            }
            if isinstance(policy, KvAware):
                t = worker_terms(policy.config, v, request.block_tokens)
                c["terms"] = {k: (None if x in (float("inf"), float("-inf")) else round(x, 3))
                              for k, x in t._asdict().items() if k != "last_routed_at"}
            cands.append(c)
        return {"worker": decision.worker, "rank": decision.rank, "policy": decision.policy,
                "reason": decision.reason, "model": model, "adapter": adapter, "prompt_blocks": P,
                "block_tokens": request.block_tokens, "candidates": cands}

    def _overlap(self, block_hashes: tuple[int, ...], model: str | None, adapter: str | None = None) -> Any:
        """Per target, the leading blocks of this prompt it is believed to hold (in `adapter`'s cache
        namespace for a LoRA request)."""
        overlap = self.prefix.overlap(self._prefix_keys(block_hashes, model, adapter))
        synced = self.kv_follower.synced if self.kv_follower is not None else ()
        if synced:  # exact mode: what the engine reports it holds beats what we sent it
            salt = namespace_salt(adapter)  # (the exact index is per worker: the adapter alone keys it)
            exact = self.exact.overlap(tuple(map(salt.__xor__, block_hashes)) if salt else block_hashes)
            overlap = overlap.override({t: exact.get(t, 0) for w in synced for t in self.targets(w)})
        return overlap

    def _exact_for(self, target: str) -> bool:
        """Whether `target`'s overlap comes from the engine's KV events (exact mode), not from the
        router's record of what it sent."""
        synced = self.kv_follower.synced if self.kv_follower is not None else ()
        if not synced:
            return False
        base = self._base.get(target)
        return (base.worker or target if base is not None else target) in synced

    def _log_decision(self, request: RouteRequest, decision: Decision, workers: Any) -> None:
        now = self._clock()
        recs = self.follower.workers
        cand = {}
        for v in workers:
            rec = recs.get(v.worker or v.name)
            age = None if rec is None or rec.metrics_at is None else round(now - rec.metrics_at, 4)
            cand[v.name] = [v.state, v.running, v.waiting, v.kv_active_blocks, v.pending,
                            v.pending_prefill_blocks, v.pending_kv_blocks, v.remote_pending, v.in_flight,
                            v.hot_blocks, v.reused_blocks, request.overlap.get(v.name, 0), age, v.prefilling]
        self._dlog.write(json.dumps({"t": round(now, 4), "worker": decision.worker, "rank": decision.rank,
                                     "reason": decision.reason,
                                     "prompt_blocks": request.prompt_blocks, "w": cand}) + "\n")

    def on_routed(self, request_id: str, request: RouteRequest, worker: str, model: str | None = None,
                  adapter: str | None = None) -> int:
        """The request is being sent to `worker` (a routing target: a worker, or a DP rank of one as
        `Decision.target` names it): count it in flight and index its prompt there
        (now, not when the worker answers: a long prefill would otherwise let the next requests
        with the same prefix miss it). A failed attempt leaves a stale entry that ages out. Returns
        the blocks it is charged as cached there: kvroute's prediction of the engine's reuse."""
        cached = request.overlap.get(worker, 0)
        keys = self._prefix_keys(request.block_hashes, model, adapter) if request.block_hashes else ()
        if cached and keys and not self._exact_for(worker):  # what its cache can still hold
            cached = min(cached, self.prefix.held_blocks(worker, keys))
        cached = min(cached, request.prompt_blocks)
        self.ledger.on_routed(request_id, worker, request.prompt_blocks, cached)
        if keys:
            self.prefix.record(worker, keys)
        return cached

    def should_hold(self, request: RouteRequest, policy_name: str | None = None,
                    exclude: set[str] | frozenset[str] = frozenset(), model: str | None = None,
                    adapter: str | None = None) -> bool:
        """Whether a streamed request should wait for a worker to free up before it is routed
        (`serve_app.admission`): every routable worker of its model is prefilling one of this
        replica's streams, and even the worker holding most of its prompt would still prefill a big
        part of it. Only for kv_aware: the other policies route as they are named."""
        adm = self.admission
        if not adm.config.enabled or (policy_name or self.default_policy) != "kv_aware":
            return False
        if not adm.waiting and not adm.prefilling:
            return False
        self.views()
        _, fleet = self._model_group(model, None, adapter)
        if not adm.saturated((v.name, v.state != "down" and (v.worker or v.name) not in exclude) for v in fleet):
            return False
        routable = {v.name for v in fleet if v.state != "down"}
        held = max((n for t, n in self._overlap(request.block_hashes, model, adapter).items() if t in routable),
                   default=0) \
            if request.block_hashes else 0
        return adm.big(request.prompt_blocks - held)  # even where most of it is cached, much is left

    def wake_held(self, model: str | None = None, adapter: str | None = None) -> None:
        """After a streamed dispatch: if requests are held while a routable worker of `model` is
        not busy, let the next one go. A held request is woken when a worker frees up, but the
        policy may route it elsewhere; without this the queue would wait for the next first token
        (or `max_wait_s`) beside an idle worker — with `max_prefilling` 2 on the Mooncake replay,
        the slowest held requests waited the full 5 s (bench/results/standard-mooncake-7.md)."""
        adm = self.admission
        if adm.waiting:
            _, fleet = self._model_group(model, None, adapter)
            if not adm.all_busy((v.name, v.state != "down") for v in fleet):
                adm.release(1)

    def route(
        self, request: RouteRequest, policy_name: str | None = None, exclude: set[str] | frozenset[str] = frozenset(),
        model: str | None = None, role: str | None = None, *, streamed: bool = False, adapter: str | None = None,
        explain: bool = False,
    ) -> "RequestTicket":
        """Decide (`decide`) and book the request on the chosen worker (`on_routed`). The ticket
        carries the decision; call its `first_token()` when the first response byte arrives, then
        exactly one of `finished()` or `failed()` (a retry elsewhere is a new `route`, with the
        failed worker in `exclude`). Raises NoWorkerAvailable, UnknownPolicy."""
        receipt: dict[str, Any] | None = {} if explain else None
        decision, request = self.decide(request, policy_name, exclude, model, role, adapter, receipt)
        request_id = f"{self.replica_id}-{next(self._request_ids)}"
        target = decision.target or decision.worker
        predicted = self.on_routed(request_id, request, target, model, adapter)
        if streamed and self.admission.config.enabled:
            self.admission.dispatched(target)
            self.wake_held(model, adapter)
            ticket = RequestTicket(decision, request, request_id, self.ledger, self.admission, predicted)
        else:
            ticket = RequestTicket(decision, request, request_id, self.ledger, None, predicted)
        ticket.receipt = receipt
        return ticket

    def check_prediction(self, ticket: "RequestTicket", prompt_tokens: int, cached_tokens: int) -> tuple[int, str | None]:
        """The engine answered `ticket`'s request with `cached_tokens` of `prompt_tokens` from its
        cache: compare with what was predicted (the blocks charged as cached, as a share of the
        router's estimate of the prompt, times the engine's real prompt length — the router's count
        is an estimate in approximate mode). Returns (predicted tokens, a warning to log or None)."""
        req = ticket.request
        est = req.prompt_tokens
        predicted = min(ticket.predicted * req.block_tokens, est)
        if est > 0 and est != prompt_tokens:
            predicted = round(predicted * prompt_tokens / est)
        predicted = max(0, min(predicted, prompt_tokens - 1))  # (SGLang always computes the last token)
        return predicted, self.predictions.observe(ticket.worker, predicted, cached_tokens, prompt_tokens,
                                                   self._clock())

    # --- public views -------------------------------------------------------------------------

    def workers_json(self) -> dict[str, Any]:
        now = time.monotonic()
        workers = []
        for rec in sorted(self.follower.workers.values(), key=lambda r: r.name):
            targets = self.targets(rec.name)
            lvs = [self.ledger.view(t, idle=rec.state == "idle") for t in targets]
            extra = {} if len(targets) == 1 else {"in_flight_by_rank": [lv.in_flight + lv.remote_pending for lv in lvs]}
            workers.append(
                {
                    "name": rec.name,
                    "url": rec.url,
                    "state": rec.state,
                    "healthy": rec.healthy,
                    "health_detail": rec.health_detail,
                    "page_size": rec.page_size,
                    "models": rec.models,
                    "role": rec.role,
                    "bootstrap_port": rec.bootstrap_port,
                    "metrics_age_s": None if rec.metrics_at is None else round(now - rec.metrics_at, 4),
                    "heartbeat_age_s": round(now - rec.heartbeat_at, 4),
                    "metrics": {f: rec.metrics[f] for f in KV_METRICS_FIELDS} if rec.metrics else None,
                    "ranks": rec.ranks,
                    "dp_size": rec.dp_size,
                    "in_flight": sum(lv.in_flight + lv.remote_pending for lv in lvs),
                    "in_flight_local": sum(lv.in_flight for lv in lvs),
                    **extra,
                    "adapters": sorted(self._adapters.get(rec.name, ())),
                    "prefix_cache_check": self.predictions.view(rec.name),
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
            "models": self.served_models(),
            "admission": {"waiting": self.admission.waiting, "held": self.admission.held,
                          "timed_out": self.admission.timed_out},
        }


class RequestTicket:
    """One routed request: its decision, the request as decided (with the overlap its ledger
    charge used), and its remaining moments. `first_token`, then one of `finished` / `failed`;
    calls after the end (or twice) are ignored, so ending from a `finally` block is safe."""

    __slots__ = ("decision", "request", "request_id", "predicted", "receipt", "_ledger", "_admission")

    def __init__(self, decision: Decision, request: RouteRequest, request_id: str, ledger: Ledger,
                 admission: Admission | None = None, predicted: int = 0) -> None:
        self.decision = decision
        self.request = request
        self.request_id = request_id
        self.predicted = predicted  # prompt blocks kvroute expects the worker's cache to serve
        self.receipt: dict[str, Any] | None = None  # the route receipt, when asked for (`decide`)
        self._ledger = ledger
        self._admission = admission  # a streamed request counted as prefilling there until its first token

    @property
    def worker(self) -> str:
        return self.decision.worker

    @property
    def url(self) -> str:
        return self.decision.url

    def first_token(self) -> None:
        """The first response byte arrived: its prefill is done (its KV blocks stay counted)."""
        self._ledger.on_first_token(self.request_id)
        self._prefilled()

    def finished(self) -> None:
        """The response ended after reaching the worker (completed, cancelled or errored)."""
        self._ledger.on_finished(self.request_id)
        self._prefilled()

    def failed(self) -> None:
        """The request never ran to completion on the worker (connect error, reset before the end)."""
        self._ledger.on_failed(self.request_id)
        self._prefilled()

    def _prefilled(self) -> None:
        adm = self._admission
        if adm is not None:
            self._admission = None
            adm.prefilled(self.decision.target or self.decision.worker)

    def __repr__(self) -> str:
        return f"RequestTicket({self.request_id!r}, worker={self.decision.worker!r})"


def _alias_roots(declared: Iterable[tuple[str, ...]]) -> dict[str, str]:
    """Model name → the least name of its alias class: names one worker declares together are one
    model, and so is any chain of such names (union-find over the workers' name lists)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = x = parent[parent[x]]
        return x

    for names in declared:
        for other in names[1:]:
            a, b = find(names[0]), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
        if names:
            find(names[0])
    return {x: find(x) for x in parent}


def _targets_of(rec: WorkerRecord) -> tuple[str, ...]:
    """A worker's routing targets: itself, or (dp_size > 1) one per attention-DP rank."""
    if rec.dp_size <= 1:
        return (rec.name,)
    return tuple(target_name(rec.name, r) for r in range(rec.dp_size))


def _has_text_prompt(body: Any) -> bool:
    return isinstance(body, dict) and (
        isinstance(body.get("messages"), list) or any(isinstance(body.get(k), str) for k in ("prompt", "text"))
    )
