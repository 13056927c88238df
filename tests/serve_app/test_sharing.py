"""serve_app.sharing: a replica's in-flight counts are pushed when they change, on heartbeat, and
again after the aggregator link failed."""

from __future__ import annotations

import asyncio

from actors.models import Settings
from serve_app import sharing


class FakeLink:
    """Stands in for actors.transport.link.AggregatorLink (ZeroMQ to a live aggregator): records pushes."""

    instances: list["FakeLink"] = []

    def __init__(self, resolve, **kwargs) -> None:
        self.pushed: list[dict[str, int]] = []
        self.fail_next = 0
        self.closed = False
        FakeLink.instances.append(self)

    async def ensure(self) -> bool:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("aggregator away")
        return True

    def push_in_flight(self, replica: str, counts: dict[str, int]) -> bool:
        self.pushed.append(dict(counts))
        return True

    def close(self) -> None:
        self.closed = True


class FakeCore:
    """RouterCore's side of sharing: its counts, and whether peers are present / active."""

    def __init__(self, present: bool = True, active: bool = True) -> None:
        self.counts: dict[str, int] = {}
        self.present = present
        self.active = active
        self.shares_taken = 0
        self.polls = 0  # the share loop's wake-ups

    def in_flight_share(self) -> dict[str, int]:
        self.shares_taken += 1
        return dict(self.counts)

    def peers(self, active_within_s: float) -> tuple[bool, bool]:
        self.polls += 1
        return self.present, self.present and self.active


async def _until(pred, timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_counts_are_pushed_on_change_and_heartbeat_and_after_a_failed_link(monkeypatch):
    monkeypatch.setattr(sharing, "AggregatorLink", FakeLink)
    FakeLink.instances.clear()
    settings = Settings(push_interval_s=0.002, heartbeat_s=0.2, reconnect_backoff_s=0.01, reconnect_backoff_max_s=0.02)
    core = FakeCore()

    async def resolve():
        return None

    task = asyncio.create_task(sharing.share_in_flight(core, "r1", resolve, settings))
    await _until(lambda: FakeLink.instances and FakeLink.instances[0].pushed)
    link = FakeLink.instances[0]
    assert link.pushed[0] == {}  # the first share goes out even when nothing is in flight
    n = len(link.pushed)
    await asyncio.sleep(0.06)
    assert len(link.pushed) == n  # unchanged counts, heartbeat not due: nothing sent
    core.counts = {"w1": 2}
    await _until(lambda: link.pushed[-1] == {"w1": 2})
    n = len(link.pushed)
    await _until(lambda: len(link.pushed) > n)  # heartbeat resends the same counts
    assert link.pushed[-1] == {"w1": 2}
    link.fail_next = 2
    core.counts = {"w1": 1, "w2": 1}
    await _until(lambda: link.pushed[-1] == {"w1": 1, "w2": 1})  # retried through the failures
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert link.closed


async def _churn(core: FakeCore, seconds: float) -> None:
    """The replica's counts change every 3 ms (several times per share interval) for `seconds`."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    k = 0
    while loop.time() - t0 < seconds:
        k += 1
        core.counts = {"w1": k % 7 + 1}
        await asyncio.sleep(0.003)


async def test_sharing_is_fast_only_with_an_active_peer(monkeypatch):
    """Alone, a replica's changing counts are never pushed (nobody reads them): one empty share per
    heartbeat keeps it known to the aggregator, and the loop wakes only a few times per heartbeat.
    With peers that are idle, its counts go once per heartbeat (so they see it is busy). With an
    active peer, at every change, the loop at its fast cadence; when the peers are gone, an empty
    share clears its counts at the next heartbeat."""
    monkeypatch.setattr(sharing, "AggregatorLink", FakeLink)
    FakeLink.instances.clear()
    settings = Settings(push_interval_s=0.002, heartbeat_s=0.2, reconnect_backoff_s=0.01, reconnect_backoff_max_s=0.02)
    core = FakeCore(present=False)

    async def resolve():
        return None

    task = asyncio.create_task(sharing.share_in_flight(core, "r1", resolve, settings))
    try:
        await _until(lambda: FakeLink.instances and FakeLink.instances[0].pushed)
        link = FakeLink.instances[0]
        polls0 = core.polls
        await _churn(core, 0.5)
        assert core.polls - polls0 <= 8  # not the fast cadence (10 ms: 50 wake-ups): per half heartbeat
        assert all(p == {} for p in link.pushed)  # alone: never the counts
        assert 2 <= len(link.pushed) <= 4  # the first announcement, then one per 0.2 s heartbeat

        core.present, core.active = True, False  # a peer, idle
        n = len(link.pushed)
        await _churn(core, 0.5)
        idle = link.pushed[n:]
        assert 2 <= len(idle) <= 4 and all(p for p in idle)  # the counts, once per heartbeat

        core.active = True
        n, polls0 = len(link.pushed), core.polls
        await _churn(core, 0.3)
        assert len(link.pushed) - n >= 10  # every change, at the 10 ms interval
        assert core.polls - polls0 >= 15  # (the first ≤ 0.1 s until the loop noticed the active peer)
        core.present = False
        await _until(lambda: link.pushed[-1] == {}, timeout_s=0.5)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
