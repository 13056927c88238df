"""actors.transport.readable.SocketWatch: a callback per arrival instead of a future per receive."""

from __future__ import annotations

import asyncio

import zmq

from actors.transport.readable import SocketWatch


def _pair(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"inproc://{name}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"inproc://{name}")
    return push, pull


def _drain_all(pull: zmq.Socket, got: list[bytes]):
    """A drain that receives until `zmq.Again` (then reports the socket empty: False)."""
    def drain() -> bool:
        while True:
            try:
                got.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return False
    return drain


async def _until(pred, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_every_frame_is_drained_including_those_sent_before_the_watch_and_in_bounded_batches():
    ctx = zmq.Context()
    push, pull = _pair(ctx, "watch-batches")
    got: list[bytes] = []

    def drain() -> bool:  # at most 3 per call, like a bounded batch
        for _ in range(3):
            try:
                got.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return False
        return True

    async def main() -> None:
        push.send(b"early")  # before the watch: no edge will ever announce it
        watch = SocketWatch(pull, drain)
        await _until(lambda: got == [b"early"])
        for i in range(10):
            push.send(b"%d" % i)
        await _until(lambda: len(got) == 11)
        watch.close()

    asyncio.run(main())
    assert got == [b"early"] + [b"%d" % i for i in range(10)]
    push.close(0), pull.close(0), ctx.term()


def test_a_paused_watch_leaves_frames_in_the_socket_until_kicked():
    ctx = zmq.Context()
    push, pull = _pair(ctx, "watch-pause")
    got: list[bytes] = []

    drain = _drain_all(pull, got)

    async def main() -> None:
        watch = SocketWatch(pull, drain)
        push.send(b"a")
        await _until(lambda: got == [b"a"])
        watch.pause()
        push.send(b"b")
        await asyncio.sleep(0.05)
        assert got == [b"a"]  # held while paused (a follower fetching its snapshot)
        watch.kick()
        await _until(lambda: got == [b"a", b"b"])
        watch.close()

    asyncio.run(main())
    push.close(0), pull.close(0), ctx.term()


def test_a_drain_that_raises_is_logged_and_the_next_arrival_is_still_seen(caplog):
    ctx = zmq.Context()
    push, pull = _pair(ctx, "watch-raise")
    got: list[bytes] = []

    def drain() -> bool:
        frame = pull.recv(zmq.NOBLOCK)
        if frame == b"bad":
            raise ValueError("boom")
        got.append(frame)
        return False

    async def main() -> None:
        watch = SocketWatch(pull, drain)
        push.send(b"bad")
        await asyncio.sleep(0.05)
        push.send(b"good")
        await _until(lambda: got == [b"good"])
        watch.close()

    asyncio.run(main())
    assert "error while draining" in caplog.text
    push.close(0), pull.close(0), ctx.term()


def test_a_paused_watch_does_not_spin_while_frames_wait():
    """While paused the descriptor leaves the loop: waiting frames must not wake it again and again."""
    ctx = zmq.Context()
    push, pull = _pair(ctx, "watch-spin")
    calls = {"n": 0}
    got: list[bytes] = []

    def drain() -> bool:
        calls["n"] += 1
        try:
            got.append(pull.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass
        return False

    async def main() -> None:
        watch = SocketWatch(pull, drain)
        await asyncio.sleep(0.01)
        watch.pause()
        for i in range(5):
            push.send(b"%d" % i)
        import time

        cpu0 = time.process_time()
        await asyncio.sleep(0.1)
        assert time.process_time() - cpu0 < 0.05, "the loop spun on a paused descriptor"
        before = calls["n"]
        watch.resume_now()
        assert calls["n"] == before + 1 and got == [b"0"]
        await _until(lambda: len(got) == 5)
        watch.close()

    asyncio.run(main())
    push.close(0), pull.close(0), ctx.term()


class _CountingSocket:
    """A PULL socket's stand-in view that counts `EVENTS` checks (everything else passes through)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.events_checks = 0

    def getsockopt(self, opt: int):
        if opt == zmq.EVENTS:
            self.events_checks += 1
        return self._sock.getsockopt(opt)

    def recv(self, flags: int = 0):
        return self._sock.recv(flags)


def test_an_exhaustive_drain_sees_every_frame_with_no_events_check_around_it():
    """`exhaustive=True`: the drain's own receive until `zmq.Again` replaces the `EVENTS` checks
    before and after it (each a libzmq call per wake-up), and nothing is missed."""
    ctx = zmq.Context()
    push, pull = _pair(ctx, "watch-exhaustive")
    view = _CountingSocket(pull)
    got: list[bytes] = []

    drain = _drain_all(pull, got)

    async def main() -> None:
        push.send(b"early")  # before the watch: no edge will ever announce it
        watch = SocketWatch(view, drain, exhaustive=True)  # type: ignore[arg-type]
        await _until(lambda: got == [b"early"])
        for i in range(20):
            push.send(b"%d" % i)
            await asyncio.sleep(0.002)
        await _until(lambda: len(got) == 21)
        watch.pause()
        push.send(b"held")
        await asyncio.sleep(0.05)
        assert got[-1] == b"19"  # paused: it waits in the socket
        watch.resume_now()
        assert got[-1] == b"held"
        watch.close()

    asyncio.run(main())
    assert got == [b"early"] + [b"%d" % i for i in range(20)] + [b"held"]
    assert view.events_checks == 0
    push.close(0), pull.close(0), ctx.term()


def test_an_exhaustive_drain_that_raises_falls_back_to_an_events_check_and_loses_nothing(caplog):
    ctx = zmq.Context()
    push, pull = _pair(ctx, "watch-exhaustive-raise")
    view = _CountingSocket(pull)
    got: list[bytes] = []

    def drain() -> bool:  # raises after one frame: it may have stopped before zmq.Again
        frame = pull.recv(zmq.NOBLOCK)
        if frame == b"bad":
            raise ValueError("boom")
        got.append(frame)
        return rest()

    rest = _drain_all(pull, got)

    async def main() -> None:
        watch = SocketWatch(view, drain, exhaustive=True)  # type: ignore[arg-type]
        push.send(b"bad")
        push.send(b"after")  # waiting behind the frame that raised: the EVENTS check finds it
        await _until(lambda: got == [b"after"])
        watch.close()

    asyncio.run(main())
    assert "error while draining" in caplog.text
    assert view.events_checks >= 1
    push.close(0), pull.close(0), ctx.term()
