"""In-flight counts shared across router replicas through the live aggregator (ZeroMQ ingest,
published deltas, real followers and share loops): a replica alone shares only its heartbeat
announcement; beside an idle second one it shares its counts once per heartbeat (the second sees
them); once both route, both share at every change and each sees the other's counts."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from actors.transport.link import AggregatorLink
from actors.models import Settings
from actors.protocol import WorkerReport
from serve_app.config import RouterConfig
from serve_app.follower import FleetFollower
from serve_app.router import RouterCore
from serve_app.sharing import share_in_flight

pytestmark = pytest.mark.ray


async def _until(pred, timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)


async def _shares(agg) -> int:
    return (await agg.stats.remote()).in_flight_shares


async def test_a_lone_replica_only_announces_itself_and_a_second_turns_sharing_on_within_a_heartbeat(agg):
    settings = Settings()  # as the aggregator and the router use them: shares every 50 ms, heartbeat 0.5 s
    tick = settings.push_interval_s * 5

    async def resolve():
        return agg

    probe = f"share-probe-{uuid.uuid4().hex[:6]}"  # the worker the counts are about
    link = AggregatorLink(resolve, hwm=10, backoff_s=0.1, backoff_max_s=0.5)
    assert await link.ensure()
    assert link.push_reports([WorkerReport(name=probe, url="http://127.0.0.1:9", page_size=16, incarnation="i",
                                           healthy=True)])
    replicas: list[tuple[RouterCore, FleetFollower, asyncio.Task]] = []

    def start(rid: str) -> RouterCore:
        follower = FleetFollower(resolve, poll_timeout_s=10)
        core = RouterCore(RouterConfig(), follower, rid)
        follower.start()
        replicas.append((core, follower, asyncio.create_task(share_in_flight(core, rid, resolve, settings))))
        return core

    busy = True

    async def churn(core: RouterCore) -> None:
        """Requests start and end on `probe` all the time: the replica's counts change at every tick."""
        started: list[str] = []
        i = 0
        while busy:
            i += 1
            if i % 8 < 4 or not started:  # 1, 2, 3, 4 in flight, then 3, 2, 1, 0, …
                started.append(f"{core.replica_id}-{i}")
                core.ledger.on_routed(started[-1], probe, 4)
            else:
                core.ledger.on_finished(started.pop(0))
            await asyncio.sleep(tick / 2)

    tag = uuid.uuid4().hex[:6]
    a_id, b_id = f"ra-{tag}", f"rb-{tag}"
    try:
        a = start(a_id)
        assert await a.follower.wait_first(10)
        # replicas of earlier tests' routers expire 2 × down_after_s after their last share
        await _until(lambda: not a.peers(settings.down_after_s)[0], settings.down_after_s * 2 + 2,
                     f"no other replica sharing (still named: {sorted(a.follower.replicas)})")
        churner = asyncio.create_task(churn(a))
        await _until(lambda: a_id in a.follower.replicas, 2, "the aggregator naming the first replica")
        n0 = await _shares(agg)
        window = 2.5
        await asyncio.sleep(window)
        alone = await _shares(agg) - n0
        # counts changed at every 50 ms tick: sharing them would be ~50 shares; announcing, ~5
        assert alone <= window / settings.heartbeat_s + 2, alone

        b = start(b_id)
        await _until(lambda: b_id in a.follower.replicas, settings.heartbeat_s * 2,
                     "the first replica learning of the second")
        assert a.peers(settings.down_after_s) == (True, False)  # present, idle

        def sees(core: RouterCore, rid: str) -> bool:
            rec = core.follower.workers.get(probe)
            return rec is not None and rec.in_flight_by_replica.get(rid, 0) > 0

        await _until(lambda: sees(b, a_id), settings.heartbeat_s * 3, "the idle replica seeing the busy one's counts")
        n0 = await _shares(agg)
        await asyncio.sleep(window)
        beside_idle = await _shares(agg) - n0
        # the busy one's counts once per heartbeat, the idle one's announcement once per heartbeat
        assert beside_idle <= 2 * (window / settings.heartbeat_s + 2), beside_idle

        churner_b = asyncio.create_task(churn(b))  # the second replica routes too
        await _until(lambda: sees(a, b_id), settings.heartbeat_s * 3, "the first replica seeing the second's counts")
        await _until(lambda: a.peers(settings.down_after_s)[1], settings.heartbeat_s * 2, "an active peer")
        n0 = await _shares(agg)
        await asyncio.sleep(1.0)
        # every tick: ~20 in a second (a tick or two may slip on a loaded 2-core CI machine), against
        # the ~4 a second of a replica alone or beside idle peers
        assert await _shares(agg) - n0 >= 0.8 / tick, "with an active peer, changed counts are shared at every tick"
        busy = False
        await churner
        await churner_b
    finally:
        busy = False
        for _, follower, task in replicas:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await follower.stop()
        link.close()
        await agg.remove.remote(probe)
