"""actors.transport.link.AggregatorLink when the aggregator goes away: real ZeroMQ sockets stand where the
aggregator's ingest listens; only its Ray handle (which hands out the address) is a stand-in. No Ray."""

from __future__ import annotations

import asyncio
import pytest
import zmq
import zmq.asyncio

from actors.transport.link import AggregatorLink
from actors.protocol import Endpoints, ReportBatch, WorkerReport, decode_ingest
from tests.ray_stub import Remote



class Handle:
    """`endpoints.remote(ip)` answers `self.answer`, or hangs while `self.hang` (Ray has not yet told
    this process that a restarting actor is alive again)."""

    def __init__(self, ingest: str) -> None:
        self.answer = Endpoints(epoch="e1", ingest=ingest, publish="tcp://127.0.0.1:1", token="t0k")
        self.hang = asyncio.Event()  # set: calls wait for `released`
        self.released = asyncio.Event()
        self.asked = 0

        async def endpoints(ip: str) -> Endpoints:
            self.asked += 1
            if self.hang.is_set():
                await self.released.wait()
            return self.answer

        self.endpoints = Remote(endpoints)


def _bind(ctx: zmq.asyncio.Context, address: str | None = None) -> tuple[zmq.asyncio.Socket, str]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    if address is None:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return sock, f"tcp://127.0.0.1:{port}"
    sock.bind(address)
    return sock, address


async def _rebind(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    """Bind `address` again once libzmq has let the closed listener's port go."""
    for _ in range(200):
        try:
            return _bind(ctx, address)[0]
        except zmq.ZMQError:
            await asyncio.sleep(0.01)
    raise AssertionError(f"{address} never came free")


def _report(seq: int) -> WorkerReport:
    return WorkerReport(name="w0", url=f"http://w0/{seq}", page_size=1, incarnation="i1", healthy=True,
                        health_detail="ok", ranks=[])


async def _push_until_received(link: AggregatorLink, ingest: zmq.asyncio.Socket, timeout_s: float) -> list[str]:
    """Push as a worker's push loop does (ensure, then push; 20 ms apart) until `ingest` gets a frame;
    the urls of the reports received."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seq = 0
    while loop.time() < deadline:
        seq += 1
        if await link.ensure():
            link.push_reports([_report(seq)])
        try:
            raw = await asyncio.wait_for(ingest.recv(), 0.02)
        except asyncio.TimeoutError:
            continue
        msg = decode_ingest(raw)
        assert isinstance(msg, ReportBatch)
        return [r.url for r in msg.reports]
    raise AssertionError(f"nothing reached the ingest in {timeout_s} s")


class Rig:
    """A link to an ingest PULL standing where the aggregator listens; `handle` says where."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ingest, self.address = _bind(self.ctx)
        self.handle = Handle(self.address)

        async def resolve() -> Handle:
            return self.handle

        self.link = AggregatorLink(resolve, ctx=self.ctx, stale_s=0.2, backoff_s=0.01, backoff_max_s=0.02,
                                   client_ip="127.0.0.1")
        self.others: list[zmq.asyncio.Socket] = []

    def close(self) -> None:
        self.handle.released.set()
        self.link.close()
        for sock in (self.ingest, *self.others):
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


async def test_an_aggregator_back_on_its_address_gets_reports_before_ray_answers(rig):
    link, handle, ctx, address = rig.link, rig.handle, rig.ctx, rig.address
    ingest = rig.ingest
    await _push_until_received(link, ingest, 5)
    assert handle.asked == 1
    handle.hang.set()  # the aggregator restarts; Ray's news of it will come late
    ingest.close(linger=0)
    for _ in range(20):  # a push loop's checks while it is down (longer than stale_s)
        await link.ensure()
        await asyncio.sleep(0.02)
    assert not await link.ensure()  # stale: no push, and no waiting on Ray either
    await asyncio.sleep(0.05)
    assert handle.asked == 2  # asked once in the background, still unanswered
    ingest = await _rebind(ctx, address)  # back on its address (Ray restarts keep it)
    rig.others.append(ingest)
    await _push_until_received(link, ingest, 5)
    assert not handle.released.is_set()  # reached it while Ray's answer was still pending
    handle.released.set()
    await asyncio.sleep(0.05)
    assert link._reresolve_task is None


async def test_an_aggregator_that_moved_is_found_through_ray_and_the_socket_replaced(rig):
    link, handle = rig.link, rig.handle
    await _push_until_received(link, rig.ingest, 5)
    rig.ingest.close(linger=0)
    new, new_address = _bind(rig.ctx)  # restarted elsewhere: another address, another token
    rig.others.append(new)
    handle.answer = Endpoints(epoch="e2", ingest=new_address, publish="tcp://127.0.0.1:1", token="n3w")
    await _push_until_received(link, new, 5)
    assert link.endpoints == handle.answer and link.epoch == "e2"
    assert link._token() == "n3w"
