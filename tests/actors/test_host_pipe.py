"""actors.host_pipe.HostPipe: several workers' SGLang frames from real PULLs into real MetricsBooks,
one coalesced HostFrame per window over a real AggregatorLink to a PULL standing where the
aggregator's ingest listens (only the aggregator's Ray handle is a stand-in). No Ray."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from actors.host_pipe import HostPipe
from actors.ingest import MetricsBook
from actors.link import AggregatorLink
from actors.models import Settings
from actors.protocol import HostFrame, RankMetrics, WorkerReport, decode_ingest
from sim.sglang_shapes import encode_kv_metrics
from tests.actors.test_metrics_pipe import BASE, AggregatorHandle, _until
from tests.ray_stub import Remote


class HostRig:
    """A host pipe between emulated SGLang schedulers (one PUSH per worker) and an emulated ingest."""

    def __init__(self, settings: Settings, names: list[str]) -> None:
        self.ctx = zmq.asyncio.Context()
        self.settings = settings
        self.ingest = self.ctx.socket(zmq.PULL)
        self.port = self.ingest.bind_to_random_port("tcp://127.0.0.1")
        self.handle = AggregatorHandle(f"tcp://127.0.0.1:{self.port}")

        async def resolve() -> AggregatorHandle:
            return self.handle

        self.link = AggregatorLink(resolve, ctx=self.ctx, hwm=settings.max_pending_pushes, client_ip="127.0.0.1",
                                   backoff_s=0.01, backoff_max_s=0.02)
        self.pipe = HostPipe("h1", self.link, settings)
        self.pulls, self.pushes, self.books = {}, {}, {}
        for n in names:
            self.add(n)
        self.frames: list[HostFrame] = []

    def add(self, name: str) -> None:
        pull = self.ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")
        book = MetricsBook(self.settings.max_frame_bytes)
        self.pulls[name], self.pushes[name], self.books[name] = pull, push, book

        def report() -> WorkerReport:
            ranks = [RankMetrics(**d) for d in book.ranks_report(1).values()]
            return WorkerReport(name=name, url=f"http://{name}", page_size=1, incarnation="i", healthy=True,
                                ranks=ranks)

        self.pipe.add(name, pull, book, report)

    def send(self, name: str, active: int) -> None:
        self.pushes[name].send(encode_kv_metrics("0.5.23", **{**BASE, "request_active_slots": active}))

    async def collect(self) -> None:
        while True:
            sock = self.ingest
            try:
                frame = await sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                if sock is self.ingest:  # cancelled from outside (teardown), not a socket closed under us
                    raise
                continue  # the ingest was closed (an aggregator restart): the new one is next
            msg = decode_ingest(frame)
            assert isinstance(msg, HostFrame)
            self.frames.append(msg)

    def latest(self, name: str) -> int | None:
        for f in reversed(self.frames):
            for r in f.reports:
                if r.name == name and r.ranks:
                    return r.ranks[0].request_active_slots
        return None

    def close(self) -> None:
        self.pipe.stop()
        self.link.close()
        for s in [*self.pulls.values(), *self.pushes.values(), self.ingest]:
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def host_rig():
    made: list[tuple[HostRig, asyncio.Task]] = []

    def make(names: list[str], **kw) -> HostRig:
        rig = HostRig(Settings(**kw), names)
        made.append((rig, asyncio.get_running_loop().create_task(rig.collect())))
        return rig

    yield make
    for rig, task in made:
        rig.pipe.stop()
        task.cancel()
        await asyncio.wait({task, *([rig.pipe._task] if rig.pipe._task else [])}, timeout=1)
        rig.close()


async def test_the_first_frame_registers_every_worker_and_later_quiet_frames_are_bare_heartbeats(host_rig):
    rig = host_rig(["a", "b", "c"], heartbeat_s=0.05)
    rig.pipe.start()
    await _until(lambda: len(rig.frames) >= 4)
    assert {r.name for r in rig.frames[0].reports} == {"a", "b", "c"}
    assert all(f.workers == ["a", "b", "c"] and f.host == "h1" and f.token == "t0k" for f in rig.frames)
    assert [f.reports for f in rig.frames[3:]] == [[]] * len(rig.frames[3:])  # heartbeats: names only


async def test_busy_workers_share_one_frame_per_coalescing_window_with_each_ones_newest_state(host_rig):
    rig = host_rig(["a", "b"], heartbeat_s=30.0, coalesce_s=0.3)
    rig.pipe.start()
    await _until(lambda: len(rig.frames) >= 1 and rig.link.ready())
    await asyncio.sleep(0.35)
    before = len(rig.frames)
    for i in range(1, 11):  # both engines send 10 frames, 20 ms apart
        rig.send("a", i)
        rig.send("b", 100 + i)
        await asyncio.sleep(0.02)
    await _until(lambda: rig.latest("a") == 10 and rig.latest("b") == 110)
    frames = rig.frames[before:]
    assert len(frames) <= 4, f"20 frames inside one window were not coalesced: {len(frames)} host frames"
    assert any({r.name for r in f.reports} == {"a", "b"} for f in frames)  # one frame carries both workers
    assert rig.books["a"].stats.frames_accepted == 10 and rig.books["b"].stats.frames_accepted == 10


async def test_a_marked_worker_is_pushed_at_once_and_a_removed_one_is_no_longer_vouched_for(host_rig):
    rig = host_rig(["a", "b"], heartbeat_s=30.0)
    rig.pipe.start()
    await _until(lambda: len(rig.frames) >= 1 and rig.link.ready())
    rig.pipe.mark("a")  # connected now: this frame (a full one if the connection is new) settles the link
    await _until(lambda: len(rig.frames) >= 2)
    await asyncio.sleep(0.05)
    n = len(rig.frames)
    rig.pipe.mark("b")
    await _until(lambda: len(rig.frames) > n)
    assert [r.name for r in rig.frames[-1].reports] == ["b"]
    assert rig.pipe.remove("a") and not rig.pipe.remove("a")
    await _until(lambda: rig.frames[-1].workers == ["b"])
    with pytest.raises(ValueError, match="already hosted"):
        rig.pipe.add("b", rig.pulls["b"], rig.books["b"], lambda: None)


async def test_after_the_aggregator_restarts_on_its_port_the_next_frame_carries_every_report(host_rig):
    rig = host_rig(["a", "b"], heartbeat_s=0.05)
    rig.pipe.start()
    await _until(lambda: len(rig.frames) >= 3 and rig.link.connections >= 1)
    full = rig.pipe.full_frames
    old, rig.ingest = rig.ingest, rig.ctx.socket(zmq.PULL)
    old.close(linger=0)  # the aggregator process dies ...
    await asyncio.sleep(0.2)
    rig.ingest.bind(f"tcp://127.0.0.1:{rig.port}")  # ... and its next incarnation binds the same port, holding nothing
    n = len(rig.frames)
    await _until(lambda: any({r.name for r in f.reports} == {"a", "b"} for f in rig.frames[n:]))
    assert rig.pipe.full_frames > full


async def test_pipes_sharing_one_link_resolve_it_once(host_rig):
    """Many hosts' pipes on one link (an emulator process) ask for it at once: one resolution, one
    socket — not one each (that ran a 125-host emulator out of file descriptors)."""
    rig = host_rig([], heartbeat_s=30.0)
    results = await asyncio.gather(*(rig.link.ensure() for _ in range(50)))
    assert all(results)
    assert rig.handle.asked == 1 and rig.link.reconnects == 1


async def test_an_emulated_worker_without_a_socket_is_pushed_through_changed(host_rig):
    rig = host_rig([], heartbeat_s=30.0, coalesce_s=0.2)
    state = {"active": 0}

    def report() -> WorkerReport:
        rank = RankMetrics(state["active"], 8, 1, 10, 0, 0.1, 0.0, 0, 0.0, state["active"])
        return WorkerReport(name="emu", url="http://emu", page_size=1, incarnation="i", healthy=True, ranks=[rank])

    rig.pipe.add("emu", None, None, report)
    rig.pipe.start()
    await _until(lambda: len(rig.frames) >= 1 and rig.link.ready())
    await asyncio.sleep(0.25)
    state["active"] = 3
    rig.pipe.changed("emu")
    await _until(lambda: rig.latest("emu") == 3)


async def test_a_hosted_workers_report_carries_what_a_worker_actors_does(tmp_path):
    """What the metrics host reports for a worker: its fleet entry's url, page size, models and PD
    role, its liveness and its ranks — the same fields `WorkerActor._report` fills in attach mode."""
    import httpx

    from actors.fleet import WorkerSpec
    from actors.hosting import Hosted

    spec = WorkerSpec(name="p0", url="http://127.0.0.1:9", metrics_endpoint=f"ipc://{tmp_path}/p0.metrics",
                      page_size=16, served_model_names=["m"], role="prefill", bootstrap_port=8998)
    ctx = zmq.asyncio.Context()
    async with httpx.AsyncClient() as http:
        w = Hosted(spec, Settings(), ctx, http, lambda: None)
        try:
            r = w.report()
            assert (r.name, r.url, r.page_size, r.models, r.role, r.bootstrap_port) == \
                ("p0", "http://127.0.0.1:9", 16, ["m"], "prefill", 8998)
            assert not r.healthy and r.ranks == [] and r.managed is None and r.kv_events_actor is None
        finally:
            await w.aclose()
    ctx.term()


async def _busy_emulated_worker(rig: HostRig, seconds: float) -> int:
    """An emulated worker whose metrics change every 10 ms for `seconds`; returns the frames it caused."""
    state = {"active": 0}

    def report() -> WorkerReport:
        rank = RankMetrics(state["active"], 8, 1, 10, 0, 0.1, 0.0, 0, 0.0, state["active"])
        return WorkerReport(name="emu", url="http://emu", page_size=1, incarnation="i", healthy=True, ranks=[rank])

    if "emu" not in rig.pipe.names():
        rig.pipe.add("emu", None, None, report)
    n = len(rig.frames)
    for _ in range(int(seconds / 0.01)):
        state["active"] += 1
        rig.pipe.changed("emu")
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    return len(rig.frames) - n


async def test_the_pipe_coalesces_over_the_fleet_wide_window_its_link_follows(host_rig):
    """The aggregator's fleet-wide window (`link.window_s`, `actors.fleet_window`) replaces
    `coalesce_s` while it is set: a large fleet's hosts push more often, a small one's as before."""
    rig = host_rig([], heartbeat_s=30.0, coalesce_s=0.25)
    rig.pipe.start()
    await _until(lambda: len(rig.frames) >= 1 and rig.link.ready())
    slow = await _busy_emulated_worker(rig, 1.0)  # coalesce_s 0.25: ~4 windows
    rig.link.window_s = 0.05
    fast = await _busy_emulated_worker(rig, 1.0)  # the fleet-wide window: ~20
    rig.link.window_s = None
    slow_again = await _busy_emulated_worker(rig, 1.0)
    assert slow <= 7 and slow_again <= 7, (slow, slow_again)
    assert fast >= 12, fast


class _WindowHandle(AggregatorHandle):
    """`host_window.remote(known, wait_s)` as the aggregator answers it: at once when the window
    differs from `known`, else when it changes (here: after a short wait)."""

    def __init__(self, ingest: str) -> None:
        super().__init__(ingest)
        self.window = 0.05
        self.polls: list[float | None] = []

        async def host_window(known, wait_s):
            self.polls.append(known)
            if known == self.window:
                await asyncio.sleep(0.05)
            return self.window

        self.host_window = Remote(host_window)


async def test_a_following_link_long_polls_the_aggregators_window_and_a_plain_one_does_not():
    ctx = zmq.asyncio.Context()
    ingest = ctx.socket(zmq.PULL)
    port = ingest.bind_to_random_port("tcp://127.0.0.1")
    handle = _WindowHandle(f"tcp://127.0.0.1:{port}")

    async def resolve():
        return handle

    following = AggregatorLink(resolve, ctx=ctx, client_ip="127.0.0.1", follow_window=True)
    plain = AggregatorLink(resolve, ctx=ctx, client_ip="127.0.0.1")
    try:
        assert following.window_s is None
        assert await following.ensure() and await plain.ensure()
        await _until(lambda: following.window_s == 0.05)
        handle.window = 0.02
        await _until(lambda: following.window_s == 0.02)
        assert handle.polls[0] is None and 0.05 in handle.polls
        assert plain.window_s is None
    finally:
        following.close()
        plain.close()
        ingest.close(linger=0)
        ctx.term()
