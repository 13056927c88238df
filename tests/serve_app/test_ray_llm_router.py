"""KvRouteRequestRouter's decisions without a Ray cluster: the fleet comes from the aggregator's own
registry logic (FleetRegistry → snapshot → FleetFollower.apply), candidates and requests are shaped
like Serve's (`replica_id`, `routing_stats`; `PendingRequest.args`, `metadata.internal_request_id`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from actors.protocol import RankMetrics, WorkerReport
from actors.aggregator.registry import FleetRegistry
from serve_app.policies import POLICIES
from serve_app.ray_llm.names import ROUTING_STATS_KEY, replica_worker_name

APP, DEP = "llm", "SGLangServer:m"


def _replica(uid: str, stats: dict | None = None) -> SimpleNamespace:
    from ray.serve._private.common import DeploymentID, ReplicaID

    rid = ReplicaID(unique_id=uid, deployment_id=DeploymentID(name=DEP, app_name=APP))
    return SimpleNamespace(replica_id=rid, routing_stats=stats or {})


def _pending(rid: str, text: str) -> SimpleNamespace:
    msg = {"role": "user", "content": text}
    return SimpleNamespace(args=[SimpleNamespace(messages=[msg], prompt=None, max_tokens=8), None],
                           metadata=SimpleNamespace(internal_request_id=rid))


def _ranks(running: int = 0) -> list[RankMetrics]:
    return [RankMetrics(request_active_slots=running, request_total_slots=256, kv_active_blocks=10,
                        kv_total_blocks=10_000, num_requests_waiting=0, gpu_cache_usage_perc=0.001,
                        gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0)]


@pytest.fixture
def router():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from serve_app.ray_llm.request_router import KvRouteRequestRouter

    r = KvRouteRequestRouter(deployment_id=DeploymentID(name=DEP, app_name=APP),
                             handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(policy="kv_aware", ray_metrics=False, router={"seed": 1})
    r._started = True  # the follower's stream needs Ray; these tests feed it snapshots directly
    return r


def _fleet(router, names: list[str]) -> None:
    reg = FleetRegistry()
    for n in names:
        reg.report(WorkerReport(name=n, url="", page_size=16, incarnation="i", healthy=True, ranks=_ranks()))
    f = router.follower
    f.on_update(f.apply(reg.snapshot()))
    f.connected, f.last_ok_at = True, time.monotonic()


async def test_a_call_without_a_prompt_is_left_to_serve(router):
    cands = [_replica("a"), _replica("b")]
    req = SimpleNamespace(args=[SimpleNamespace(model="m")], metadata=SimpleNamespace(internal_request_id="x"))
    assert await router.choose_replicas(cands, req) == [cands]
    assert router.decisions == {"no_prompt": 1}


async def test_no_snapshot_yet_means_load_balancing(router):
    cands = [_replica("a"), _replica("b")]
    assert await router.choose_replicas(cands, _pending("r1", "hello")) == [cands]
    assert router.decisions == {"aggregator_stale": 1}


async def test_an_aggregator_silent_past_stale_after_s_means_load_balancing(router):
    cands = [_replica("a"), _replica("b")]
    _fleet(router, [replica_worker_name(c.replica_id) for c in cands])
    router.follower.connected = False
    router.follower.last_ok_at = time.monotonic() - router.stale_after_s - 1
    assert await router.choose_replicas(cands, _pending("r1", "hello")) == [cands]
    assert router.decisions == {"aggregator_stale": 1}


async def test_candidates_unknown_to_the_fleet_are_load_balanced(router):
    _fleet(router, ["serve:other/app/z"])
    cands = [_replica("a"), _replica("b")]
    assert await router.choose_replicas(cands, _pending("r1", "hello")) == [cands]
    assert router.decisions == {"no_metrics": 1}


async def test_the_pick_comes_first_with_unregistered_replicas_and_is_charged_at_once(router):
    a, b, new = _replica("a"), _replica("b"), _replica("new")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    ranks = await router.choose_replicas([a, b, new], _pending("r1", "hello " * 50))
    assert len(ranks) == 2 and ranks[0][1] is new and len(ranks[1]) == 1
    pick, other = ranks[0][0], ranks[1][0]
    assert {pick.replica_id.unique_id, other.replica_id.unique_id} == {"a", "b"}
    ledger = router.core.ledger
    assert ledger.in_flight(replica_worker_name(pick.replica_id)) == 1  # before Serve reports it routed


async def test_serve_taking_another_rank_moves_the_charge_and_completion_releases_it(router):
    a, b = _replica("a"), _replica("b")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    req = _pending("r1", "hello " * 50)
    ranks = await router.choose_replicas([a, b], req)
    pick, other = ranks[0][0], ranks[1][0]
    router.on_request_routed(req, other.replica_id, None)
    ledger = router.core.ledger
    assert ledger.in_flight(replica_worker_name(pick.replica_id)) == 0
    assert ledger.in_flight(replica_worker_name(other.replica_id)) == 1
    router.on_request_completed(other.replica_id, "r1")
    assert ledger.in_flight(replica_worker_name(other.replica_id)) == 0


async def test_a_retried_choice_does_not_charge_twice(router):
    a, b = _replica("a"), _replica("b")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    req = _pending("r1", "hello " * 50)
    await router.choose_replicas([a, b], req)
    await router.choose_replicas([a, b], req)  # Serve backs off and asks again for the same request
    ledger = router.core.ledger
    assert sum(ledger.in_flight(replica_worker_name(r.replica_id)) for r in (a, b)) == 1


async def test_shared_prefix_requests_keep_to_one_replica(router):
    cands = [_replica(u) for u in "abcd"]
    _fleet(router, [replica_worker_name(c.replica_id) for c in cands])
    shared = " ".join(f"system rule {i}" for i in range(400))
    picks = []
    for i in range(6):
        req = _pending(f"r{i}", f"{shared} question {i}")
        ranks = await router.choose_replicas(cands, req)
        router.on_request_routed(req, ranks[0][0].replica_id, None)
        picks.append(ranks[0][0].replica_id.unique_id)
    assert len(set(picks)) == 1, picks
    assert router.decisions.get("prefix", 0) == 5


async def test_a_replica_naming_its_worker_in_routing_stats_is_found_by_that_name(router):
    named = _replica("x", {ROUTING_STATS_KEY: "sim-0"})
    _fleet(router, ["sim-0"])
    ranks = await router.choose_replicas([named], _pending("r1", "hello"))
    assert ranks == [[named]]
    assert router.decisions == {"load": 1}
    assert router.core.ledger.in_flight("sim-0") == 1


async def test_a_first_token_signal_from_the_ingress_thread_releases_the_prefill_charge(router):
    import asyncio
    import threading

    from serve_app.ray_llm import first_token

    a, b = _replica("a"), _replica("b")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    req = _pending("r1", "a long prompt " * 200)
    ranks = await router.choose_replicas([a, b], req)
    router.on_request_routed(req, ranks[0][0].replica_id, None)
    worker = replica_worker_name(ranks[0][0].replica_id)
    ledger = router.core.ledger
    assert ledger.view(worker).pending_prefill_blocks > 0
    first_token.first_token("someone-else")  # another deployment's request: ignored
    t = threading.Thread(target=first_token.first_token, args=("r1",))  # Serve's ingress runs elsewhere
    t.start()
    t.join()
    for _ in range(5):
        await asyncio.sleep(0)
    assert ledger.view(worker).pending_prefill_blocks == 0
    assert ledger.in_flight(worker) == 1 and router.first_tokens == 1  # still in flight until completed




async def test_replicas_registered_before_their_first_kv_metrics_are_routable(router):
    """A replica whose collector has registered it but whose engine sent no KvMetrics yet (idle, no
    ranks) is a routing target like the others: kv_aware decides from the ledger alone and spreads."""
    cands = [_replica(u) for u in "ab"]
    reg = FleetRegistry()
    for c in cands:
        reg.report(WorkerReport(name=replica_worker_name(c.replica_id), url="", page_size=16, incarnation="i",
                                healthy=True, ranks=[]))
    f = router.follower
    f.on_update(f.apply(reg.snapshot()))
    f.connected, f.last_ok_at = True, time.monotonic()
    assert all(rec.metrics is None for rec in f.workers.values())
    picks = []
    for i in range(4):
        ranks = await router.choose_replicas(cands, _pending(f"r{i}", f"distinct prompt {i} " * 60))
        assert len(ranks) == 2
        picks.append(ranks[0][0].replica_id.unique_id)
    assert set(picks) == {"a", "b"}, picks  # in-flight charges spread them
    assert router.decisions == {"load": 4}



async def test_the_sweep_removes_only_this_deployments_down_replicas_that_serve_no_longer_has(router):
    """A crashed replica cannot deregister itself and the aggregator keeps a down worker for good: the
    router removes it once Serve's replica set no longer has it. A down replica Serve still lists (slow,
    restarting), a live one Serve does not list yet (starting), and other deployments' workers stay."""
    names = {u: replica_worker_name(_replica(u).replica_id) for u in ("crashed", "slow", "starting", "ok")}
    other = "serve:other-app/SGLangServer:m/zz"
    reg = FleetRegistry()
    for u, n in names.items():
        reg.report(WorkerReport(name=n, url="", page_size=16, incarnation="i", ranks=_ranks(),
                                healthy=u not in ("crashed", "slow")))
    reg.report(WorkerReport(name=other, url="", page_size=16, incarnation="i", healthy=False, ranks=_ranks()))
    f = router.follower
    f.on_update(f.apply(reg.snapshot()))
    assert {n: r.state for n, r in f.workers.items()}[names["crashed"]] == "down"

    removed_at_aggregator: list[str] = []

    async def _remove(name: str) -> bool:
        removed_at_aggregator.append(name)
        return True

    fake = SimpleNamespace(remove=SimpleNamespace(remote=_remove))

    async def _resolve():
        return fake

    router._resolve_aggregator = _resolve
    serve_has = {names["slow"], names["ok"]}
    assert await router.sweep(serve_has) == [names["crashed"]]
    assert removed_at_aggregator == [names["crashed"]] and router.swept == 1
    removed_at_aggregator.clear()
    assert await router.sweep(set(names.values())) == []  # every down one still a Serve replica
    assert not removed_at_aggregator


async def test_a_request_cancelled_while_serve_routes_it_releases_its_charge(router):
    """The caller gives up after kvroute chose (Serve still probing or backing off): Serve cancels the
    request's routing future and reports nothing more — the charge made at the choice is released."""
    import asyncio

    a, b = _replica("a"), _replica("b")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    req = _pending("r1", "hello " * 50)
    req.future = asyncio.get_running_loop().create_future()
    ranks = await router.choose_replicas([a, b], req)
    pick = replica_worker_name(ranks[0][0].replica_id)
    assert router.core.ledger.in_flight(pick) == 1
    req.future.cancel()
    await asyncio.sleep(0)  # done callbacks run on the loop
    assert router.core.ledger.in_flight(pick) == 0 and not router._charged


async def test_a_fulfilled_choice_keeps_its_charge_until_serve_reports_the_end(router):
    import asyncio

    a, b = _replica("a"), _replica("b")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    req = _pending("r1", "hello " * 50)
    req.future = asyncio.get_running_loop().create_future()
    ranks = await router.choose_replicas([a, b], req)
    req.future.set_result(ranks[0][0])
    await asyncio.sleep(0)
    pick = replica_worker_name(ranks[0][0].replica_id)
    assert router.core.ledger.in_flight(pick) == 1
    router.on_request_routed(req, ranks[0][0].replica_id, None)
    router.on_request_completed(ranks[0][0].replica_id, "r1")
    assert router.core.ledger.in_flight(pick) == 0


async def test_a_request_completed_without_being_reported_routed_is_released(router):
    """Serve sends without the replica's accept (Ray Client, the handle's choose_replica/dispatch API
    Ray Serve LLM's prefill/decode pattern uses) and never calls on_request_routed, only
    on_request_completed: the charge must not stay in the ledger for ever."""
    a, b = _replica("a"), _replica("b")
    _fleet(router, [replica_worker_name(a.replica_id), replica_worker_name(b.replica_id)])
    ledger = router.core.ledger
    for i in range(5):
        req = _pending(f"r{i}", f"prompt {i} " * 50)
        ranks = await router.choose_replicas([a, b], req)
        router.on_request_completed(ranks[0][0].replica_id, f"r{i}")
    assert sum(ledger.in_flight(replica_worker_name(r.replica_id)) for r in (a, b)) == 0
    assert not router._charged and not router._routed


@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_every_kvroute_policy_is_selectable_by_the_policy_kwarg(policy):
    """`request_router_kwargs: {policy: <name>}` works for each of kvroute's policies: the router's core
    decides with it, the pick comes first and is charged, and the decision is counted under that policy."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from serve_app.ray_llm.request_router import KvRouteRequestRouter

    r = KvRouteRequestRouter(deployment_id=DeploymentID(name=DEP, app_name=APP),
                             handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(policy=policy, ray_metrics=False, router={"seed": 1})
    r._started = True
    seen: list[tuple[str, str]] = []
    r.exporter = SimpleNamespace(on_decision=lambda p, reason, s: seen.append((p, reason)))
    cands = [_replica(u) for u in "abc"]
    _fleet(r, [replica_worker_name(c.replica_id) for c in cands])
    req = _pending("r1", "pick one " * 40)
    ranks = await r.choose_replicas(cands, req)
    assert r.config.policy == policy
    assert len(ranks) == 2 and len(ranks[0]) == 1 and len(ranks[1]) == 2
    assert r.core.ledger.in_flight(replica_worker_name(ranks[0][0].replica_id)) == 1
    assert seen and seen[0][0] == policy and seen[0][1] in ("prefix", "load"), seen


def test_an_unknown_policy_kwarg_is_refused_with_the_valid_names():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from serve_app.ray_llm.request_router import KvRouteRequestRouter

    r = KvRouteRequestRouter(deployment_id=DeploymentID(name=DEP, app_name=APP),
                             handle_source=DeploymentHandleSource.UNKNOWN)
    with pytest.raises(ValueError, match="kv_aware"):
        r.initialize_state(policy="kv_awre", ray_metrics=False)


class _Gauge:
    """Stands in for a `ray.util.metrics` metric: the last value per tag set, as Ray's exporter keeps it."""

    def __init__(self) -> None:
        self.values: dict[tuple, float] = {}

    def set(self, value: float, tags: dict) -> None:
        self.values[tuple(sorted(tags.items()))] = value

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def observe(self, value: float, tags: dict | None = None) -> None:
        pass

    def of(self, **tags: str) -> dict[tuple, float]:
        return {k: v for k, v in self.values.items() if all((t, tags[t]) in k for t in tags)}


def test_ray_gauges_show_dp_ranks_and_forget_a_replica_that_left_the_fleet(router):
    """Ray keeps a gauge's last value per tag set while the router's process lives: a replica that left
    the fleet must not stay `live` in the dashboard's worker table; an attention-DP replica's ranks get
    their own series (the per-worker ones sum them), as kvroute's own `/metrics` has them."""
    from serve_app.ray_llm.ray_metrics import RouterExporter

    gauges: dict[str, _Gauge] = {}
    exporter = RouterExporter(router.core, DEP, make=lambda n: gauges.setdefault(n, _Gauge()))
    a, b = replica_worker_name(_replica("a").replica_id), replica_worker_name(_replica("b").replica_id)
    reg = FleetRegistry()
    dp = [RankMetrics(request_active_slots=r + 1, request_total_slots=256, kv_active_blocks=10 * (r + 1),
                      kv_total_blocks=1000, num_requests_waiting=r, gpu_cache_usage_perc=0.01 * (r + 1),
                      gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=r) for r in range(2)]
    reg.report(WorkerReport(name=a, url="", page_size=16, incarnation="i", healthy=True, ranks=_ranks()))
    reg.report(WorkerReport(name=b, url="", page_size=16, incarnation="i", healthy=True, ranks=dp))
    f = router.follower
    f.on_update(f.apply(reg.take_delta()))
    exporter.export_fleet()

    state = gauges["kvroute_worker_state"]
    assert state.of(worker=a, state="live") and list(state.of(worker=a, state="live").values()) == [1.0]
    assert list(gauges["kvroute_worker_running_requests"].of(worker=b).values()) == [3]  # 1 + 2, summed
    rank_kv = gauges["kvroute_worker_rank_kv_usage_ratio"]
    assert {dict(k)["rank"]: v for k, v in rank_kv.of(worker=b).items()} == {"0": 0.01, "1": 0.02}
    assert {dict(k)["rank"]: v for k, v in gauges["kvroute_worker_rank_waiting_requests"].of(worker=b).items()} \
        == {"0": 0, "1": 1}
    assert not rank_kv.of(worker=a)  # one rank: the per-worker series say it all

    reg.remove(b)  # stopped (or down past the timeout): gone from the fleet
    f.on_update(f.apply(reg.take_delta()))
    exporter.export_fleet()
    assert set(state.of(worker=b).values()) == {0.0}  # in no state: the worker table drops it
    assert set(rank_kv.of(worker=b).values()) == {0.0}
    assert list(gauges["kvroute_worker_metrics_age_seconds"].of(worker=b).values()) == [-1.0]
    assert list(state.of(worker=a, state="live").values()) == [1.0]  # the others untouched
    exporter.export_fleet()  # cleared once, not re-exported
    assert set(state.of(worker=b).values()) == {0.0}
