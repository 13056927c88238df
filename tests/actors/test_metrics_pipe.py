"""actors.worker.metrics_pipe.MetricsPipe: SGLang frames from a real PULL into a real MetricsBook, coalesced
reports over a real AggregatorLink to a PULL standing where the aggregator's ingest listens (only
the aggregator's Ray handle, which hands out that address, is a stand-in). No Ray."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio

from actors.worker.ingest import MetricsBook
from actors.transport.link import AggregatorLink
from actors.worker.metrics_pipe import MetricsPipe
from actors.models import Settings
from actors.protocol import Endpoints, RankMetrics, ReportBatch, WorkerReport, decode_ingest
from sim.sglang_shapes import encode_kv_metrics
from tests.ray_stub import Remote

BASE = dict(request_active_slots=1, request_total_slots=8, kv_active_blocks=100, kv_total_blocks=1600,
            num_requests_waiting=0, gpu_cache_usage_perc=0.0625, gpu_prefix_cache_hit_rate=0.0,
            data_parallel_rank=0)



class AggregatorHandle:
    """The aggregator's Ray handle as AggregatorLink uses it: `endpoints.remote(ip)` says where its
    ingest listens. `fail` first answers raise (an aggregator not up yet)."""

    def __init__(self, ingest: str, fail: int = 0) -> None:
        self.fail = fail
        self.asked = 0

        async def endpoints(ip: str) -> Endpoints:
            self.asked += 1
            if self.fail:
                self.fail -= 1
                raise ConnectionError("aggregator not up yet")
            return Endpoints(epoch="e1", ingest=ingest, publish="tcp://127.0.0.1:1", token="t0k")

        self.endpoints = Remote(endpoints)


class Rig:
    """A metrics pipe between an emulated SGLang scheduler (PUSH) and an emulated aggregator ingest (PULL)."""

    def __init__(self, settings: Settings, fail: int = 0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.settings = settings
        self.pull = self.ctx.socket(zmq.PULL)  # where SGLang's scheduler pushes
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.sglang = zmq.Context.instance().socket(zmq.PUSH)
        self.sglang.setsockopt(zmq.LINGER, 0)
        self.sglang.connect(f"tcp://127.0.0.1:{port}")
        self.ingest = self.ctx.socket(zmq.PULL)  # the aggregator's ingest
        iport = self.ingest.bind_to_random_port("tcp://127.0.0.1")
        self.handle = AggregatorHandle(f"tcp://127.0.0.1:{iport}", fail=fail)

        async def resolve() -> AggregatorHandle:
            return self.handle

        self.book = MetricsBook(settings.max_frame_bytes)
        self.link = AggregatorLink(resolve, ctx=self.ctx, hwm=settings.max_pending_pushes, client_ip="127.0.0.1",
                                   backoff_s=0.01, backoff_max_s=0.02)
        self.reports: list[WorkerReport] = []
        self.tokens: list[str] = []
        self.health = (True, "ok")
        self.pipe = MetricsPipe("w0", self.pull, self.book, self.link, settings, self.report)

    def report(self) -> WorkerReport:
        ranks = [RankMetrics(**d) for d in self.book.ranks_report(1).values()]
        return WorkerReport(name="w0", url="http://w0", page_size=1, incarnation="i1",
                            healthy=self.health[0], health_detail=self.health[1], ranks=ranks)

    def send(self, active: int) -> None:
        self.sglang.send(encode_kv_metrics("0.5.23", **{**BASE, "request_active_slots": active}))

    async def collect(self) -> None:
        while True:
            msg = decode_ingest(await self.ingest.recv())
            assert isinstance(msg, ReportBatch)
            self.tokens.append(msg.token)
            self.reports.extend(msg.reports)

    def latest_active(self) -> list[int | None]:
        return [r.ranks[0].request_active_slots if r.ranks else None for r in self.reports]

    def close(self) -> None:
        self.pipe.stop()
        self.link.close()
        self.sglang.close(linger=0)
        self.pull.close(linger=0)
        self.ingest.close(linger=0)
        self.ctx.term()


async def _until(pred, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.fixture
async def rig_factory():
    made: list[tuple[Rig, asyncio.Task]] = []

    def make(**kw: Any) -> Rig:
        fail = kw.pop("fail", 0)
        rig = Rig(Settings(**kw), fail=fail)
        made.append((rig, asyncio.get_running_loop().create_task(rig.collect())))
        return rig

    yield make
    for rig, task in made:
        rig.pipe.stop()
        task.cancel()
        await asyncio.wait({task, *rig.pipe.tasks}, timeout=1)
        rig.close()


async def test_a_change_is_pushed_at_once_then_a_burst_is_coalesced_into_one_push_of_the_newest(rig_factory):
    rig = rig_factory(coalesce_s=0.5, heartbeat_s=30.0)
    rig.pipe.start()
    await _until(lambda: rig.link.ready())  # the push loop connected (and sent its first, empty report)
    await _until(lambda: len(rig.reports) >= 1)
    before = len(rig.reports)
    await asyncio.sleep(0.6)  # past coalesce_s since that push: the next change goes at once
    rig.send(1)
    await _until(lambda: 1 in rig.latest_active())
    for active in range(2, 12):  # changes 20 ms apart, inside one coalescing window
        await asyncio.sleep(0.02)
        rig.send(active)
    await _until(lambda: rig.latest_active()[-1:] == [11])
    after = rig.latest_active()[before:]
    assert after[0] == 1 and after[-1] == 11
    assert len(after) <= 4, f"10 changes inside a 0.5 s window were not coalesced: {after}"
    assert rig.book.stats.frames_accepted == 11
    assert set(rig.tokens) == {"t0k"}  # every frame carries the aggregator's token


async def test_multipart_messages_are_refused_and_counted_and_the_next_frame_still_lands(rig_factory):
    rig = rig_factory(heartbeat_s=30.0)
    rig.pipe.start()
    rig.sglang.send_multipart([b"a", b"b", b"c"])
    rig.send(7)
    await _until(lambda: 7 in rig.latest_active())
    assert rig.book.stats.refused == {"multipart": 1}
    assert rig.book.stats.frames_received == 2 and rig.book.stats.frames_accepted == 1
    assert rig.book.last_error == "multipart message"


async def test_without_frames_the_heartbeat_pushes_and_a_wake_pushes_the_new_state_at_once(rig_factory):
    rig = rig_factory(heartbeat_s=0.05)
    rig.pipe.start()
    await _until(lambda: len(rig.reports) >= 3)  # heartbeats, no frame ever sent
    assert all(not r.ranks and r.healthy for r in rig.reports)
    rig.pipe.stop()
    await asyncio.wait(rig.pipe.tasks, timeout=1)
    assert all(t.done() for t in rig.pipe.tasks)

    slow = rig_factory(heartbeat_s=30.0)
    slow.pipe.start()
    await _until(lambda: len(slow.reports) >= 1)
    slow.health = (False, "engine gone")
    slow.pipe.wake.set()  # what a liveness change does: no wait for the 30 s heartbeat
    await _until(lambda: not slow.reports[-1].healthy)
    assert slow.reports[-1].health_detail == "engine gone"


async def test_the_callers_wake_event_is_the_pipes_and_nothing_is_pushed_after_stop(rig_factory):
    rig = rig_factory(heartbeat_s=30.0, coalesce_s=0.2)
    wake = asyncio.Event()
    rig.pipe = MetricsPipe("w0", rig.pull, rig.book, rig.link, rig.settings, rig.report, wake=wake)
    assert rig.pipe.wake is wake
    rig.pipe.start()
    await _until(lambda: len(rig.reports) >= 1)
    rig.send(1)
    await _until(lambda: 1 in rig.latest_active())
    rig.send(2)
    await _until(lambda: 2 in rig.latest_active())  # sent inside a coalescing window: pushed at its end
    rig.pipe.stop()
    await asyncio.wait(rig.pipe.tasks, timeout=1)
    n = len(rig.reports)
    rig.send(3)
    wake.set()
    await asyncio.sleep(0.4)
    assert len(rig.reports) == n and 3 not in rig.latest_active()


async def test_an_aggregator_not_up_yet_is_retried_and_then_gets_the_newest_state(rig_factory):
    rig = rig_factory(heartbeat_s=30.0, reconnect_backoff_s=0.01, reconnect_backoff_max_s=0.02, fail=3)
    rig.pipe.start()
    rig.send(5)
    await _until(lambda: rig.book.stats.frames_accepted == 1)
    await _until(lambda: 5 in rig.latest_active())
    assert rig.handle.asked >= 4  # three refusals, then the answer
