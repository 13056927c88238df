"""The upstream client against a real HTTP server on loopback (aiohttp.web): streamed bodies pass
through byte for byte, batching never holds the first chunk or the end, errors come out typed."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from serve_app.proxy import UPSTREAM_ERRORS, UpstreamClient, UpstreamError

EVENTS = [f"data: {{\"i\": {i}}}\n\n".encode() for i in range(8)]


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"

def _slow_stream(events: list[bytes], gap_s: float, closed: asyncio.Event):
    """A worker streaming `events` `gap_s` apart that sets `closed` when its client goes away."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for ev in events:
                await resp.write(ev)
                await asyncio.sleep(gap_s)
        except (ConnectionResetError, asyncio.CancelledError):
            closed.set()
            raise
        await resp.write_eof()
        return resp
    return handler



def _sse_handler(gaps_s: list[float], tail_wait_s: float = 0.0):
    """One chunked SSE event per write; gaps_s[i] is the pause before event i+1."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-upstream": "yes"})
        await resp.prepare(request)
        for i, ev in enumerate(EVENTS):
            await resp.write(ev)
            if i < len(gaps_s):
                await asyncio.sleep(gaps_s[i])
        await asyncio.sleep(tail_wait_s)
        await resp.write_eof()
        return resp

    return handler


async def _collect(batch_s: float, handler) -> tuple[list[bytes], list[float], dict[str, str]]:
    runner, url = await _serve(handler)
    client = UpstreamClient(2.0, 10.0)
    try:
        up = await client.open("w", "POST", url + "/v1/chat/completions", content=b"{}")
        headers = up.headers()
        got, at = [], []
        async for chunk in up.chunks(batch_s):
            got.append(chunk)
            at.append(time.monotonic())
        await up.close()
        return got, at, headers
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_unbatched_stream_passes_every_event_through_unchanged():
    got, _, headers = await _collect(0.0, _sse_handler([0.03] * 7))
    assert b"".join(got) == b"".join(EVENTS)
    assert len(got) == len(EVENTS)  # 30 ms apart: one read each
    assert headers["x-upstream"] == "yes" and "content-length" not in {k.lower() for k in headers}


async def test_batching_sends_the_first_two_events_at_once_then_groups_the_rest():
    # event 1 (the first token after SGLang's role chunk) comes 50 ms after event 0 and must not be
    # held; events 2..7 arrive within ~15 ms of each other and leave together
    got, at, _ = await _collect(0.3, _sse_handler([0.05, 0.1] + [0.002] * 5))
    assert b"".join(got) == b"".join(EVENTS)
    assert got[0] == EVENTS[0] and got[1] == EVENTS[1]
    assert at[1] - at[0] < 0.25  # not held for the 300 ms interval
    assert len(got) <= 4  # then one or two reads for the remaining six events (not six)


async def test_role_and_first_token_in_one_read_start_the_batching():
    # both opening events in the first read: the next one is already batched
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(EVENTS[0] + EVENTS[1])
        for ev in EVENTS[2:]:
            await asyncio.sleep(0.01)
            await resp.write(ev)
        await asyncio.sleep(0.3)
        await resp.write_eof()
        return resp

    got, _, _ = await _collect(0.2, handler)
    assert b"".join(got) == b"".join(EVENTS)
    assert got[0] == EVENTS[0] + EVENTS[1]
    assert len(got) <= 3


async def test_batching_never_holds_the_end_of_the_body():
    # with a 5 s interval, the stream still ends as soon as the server's last chunk arrives
    t0 = time.monotonic()
    got, _, _ = await _collect(5.0, _sse_handler([0.0] * 7, tail_wait_s=0.1))
    assert b"".join(got) == b"".join(EVENTS)
    assert time.monotonic() - t0 < 2.5


async def test_retryable_status_is_an_upstream_error_with_retry_after():
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=503, text="engine overloaded", headers={"retry-after": "7"})

    runner, url = await _serve(handler)
    client = UpstreamClient(2.0, 10.0)
    try:
        with pytest.raises(UpstreamError) as ei:
            await client.open("w0", "POST", url + "/x", content=b"{}")
        assert ei.value.status == 503 and ei.value.retry_after == "7" and ei.value.worker == "w0"
        assert "engine overloaded" in str(ei.value)
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_connection_refused_is_an_upstream_error():
    runner, url = await _serve(_sse_handler([]))
    await runner.cleanup()  # nothing listens there any more
    client = UpstreamClient(1.0, 10.0)
    try:
        with pytest.raises(UpstreamError) as ei:
            await client.open("w1", "POST", url + "/x", content=b"{}")
        assert ei.value.status is None and "w1" in str(ei.value)
    finally:
        await client.aclose()


def _first_event_then(after):
    """A worker that sends one SSE event, then does `after(request)` instead of finishing."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(EVENTS[0])
        await after(request)
        return resp

    return handler


async def test_a_stream_cut_mid_body_raises_an_upstream_error_type():
    async def die(request: web.Request) -> None:
        await asyncio.sleep(0.05)
        request.transport.close()  # the worker dies without ending the chunked body

    runner, url = await _serve(_first_event_then(die))
    client = UpstreamClient(2.0, 10.0)
    try:
        up = await client.open("w", "POST", url + "/x", content=b"{}")
        got = []
        with pytest.raises(UPSTREAM_ERRORS):
            async for chunk in up.chunks(0.01):
                got.append(chunk)
        assert got == [EVENTS[0]]
        await up.close()
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_read_timeout_bounds_a_silent_worker():
    async def go_silent(request: web.Request) -> None:
        await asyncio.sleep(1.5)

    runner, url = await _serve(_first_event_then(go_silent))
    client = UpstreamClient(2.0, 0.3)
    try:
        up = await client.open("w", "POST", url + "/x", content=b"{}")
        t0 = time.monotonic()
        with pytest.raises(UPSTREAM_ERRORS):
            async for _ in up.chunks(0.0):
                pass
        assert time.monotonic() - t0 < 3
        await up.close()
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_a_slow_worker_is_a_timeout_that_never_opens_its_breaker():
    """A worker that does not answer in time (an overloaded engine, or this replica's own event
    loop running late) fails the attempt as a timeout, which is retried elsewhere but is no
    evidence the worker is broken; a refused connection and a 5xx are."""
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2.0)
        return web.Response(text="late")

    runner, url = await _serve(slow)
    client = UpstreamClient(0.2, 0.3)  # header read bound: 0.3 s
    try:
        with pytest.raises(UpstreamError) as info:
            await client.open("w", "POST", url + "/v1/chat/completions", content=b"{}")
        assert info.value.timeout and not info.value.counts_for_breaker
    finally:
        await client.aclose()
        await runner.cleanup()

    # nothing listens on this port any more: refused at once, which is evidence
    client = UpstreamClient(0.5, 0.5)
    try:
        with pytest.raises(UpstreamError) as info:
            await client.open("w", "POST", url + "/v1/chat/completions", content=b"{}")
        assert not info.value.timeout and info.value.counts_for_breaker
    finally:
        await client.aclose()
    assert UpstreamError("w", "status 503", 503).counts_for_breaker
    assert not UpstreamError("w", "status 429", 429).counts_for_breaker


async def test_a_large_body_is_read_whole_and_the_connection_is_reused():
    """Bodies above the relay's buffer bound (1 MiB) are read whole, not stalled; a connection whose
    response ended is pooled and serves the next request."""
    big = b"x" * (3 << 20)
    peers: list[tuple] = []

    async def handler(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(body=big if request.path == "/big" else b"small")

    runner, url = await _serve(handler)
    client = UpstreamClient(2.0, 10.0)
    try:
        up = await client.open("w", "GET", url + "/big")
        assert await up.read() == big
        await up.close()
        up = await client.open("w", "GET", url + "/small")
        assert await up.read() == b"small"
        await up.close()
        assert len(peers) == 2 and peers[0] == peers[1]  # one connection, kept alive
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_a_stream_closed_early_closes_its_connection():
    """A relay that stops before the end (the client went away) closes the worker's connection —
    what makes SGLang abort the request — and the next request gets a fresh one."""
    closed = asyncio.Event()

    handler = _slow_stream(EVENTS, 0.05, closed)

    runner, url = await _serve(handler)
    client = UpstreamClient(2.0, 10.0)
    try:
        up = await client.open("w", "POST", url + "/x", content=b"{}")
        async for chunk in up.chunks(0.0):
            assert chunk == EVENTS[0]
            break
        await up.close()
        await asyncio.wait_for(closed.wait(), 2.0)
        up = await client.open("w", "POST", url + "/x", content=b"{}")
        assert b"".join([c async for c in up.chunks(0.0)]) == b"".join(EVENTS)
        assert up.at_eof
        await up.close()
    finally:
        await client.aclose()
        await runner.cleanup()


# --- holding reads while a batch waits (`chunks(hold_reads=True)`) ---------------------------------

TOKENS = [f"data: {{\"token\": {i}, \"text\": \"t{i}\"}}\n\n".encode() for i in range(30)]


def _token_worker(gap_s: float, events: list[bytes] = TOKENS, end: str = "eof"):
    """A worker that writes one SSE event per token, `gap_s` apart (one write each), then ends the
    body (`end="eof"`) or drops the connection without ending it (`end="drop"`)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for ev in events:
            await resp.write(ev)
            await asyncio.sleep(gap_s)
        if end == "drop":
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    return handler


@pytest.fixture
def reads(monkeypatch):
    """Counts the upstream connection's reads (each `data_received` is one loop wake-up + recv)."""
    from serve_app import proxy

    counter = {"n": 0}
    original = proxy._Connection.data_received

    def counting(self, data):
        counter["n"] += 1
        return original(self, data)

    monkeypatch.setattr(proxy._Connection, "data_received", counting)
    return counter


async def _relay(url: str, batch_s: float, hold: bool, client: UpstreamClient) -> tuple[list[bytes], float]:
    up = await client.open("w", "POST", url + "/v1/chat/completions", content=b"{}")
    got = [c async for c in up.chunks(batch_s, hold_reads=hold)]
    assert up.at_eof
    await up.close()
    return got, time.monotonic()


LONG = [f"data: {{\"token\": {i}, \"text\": \"t{i}\"}}\n\n".encode() for i in range(80)]


async def test_holding_reads_takes_a_pieces_tokens_in_one_read_and_every_byte_arrives_in_order(reads):
    runner, url = await _serve(_token_worker(0.004, LONG))
    client = UpstreamClient(2.0, 10.0)
    try:
        got, _ = await _relay(url, 0.05, False, client)
        reads_free, pieces_free = reads["n"], len(got)
        assert b"".join(got) == b"".join(LONG)
        reads["n"] = 0
        got, _ = await _relay(url, 0.05, True, client)
        reads_held, pieces_held = reads["n"], len(got)
        assert b"".join(got) == b"".join(LONG)  # whole, in order, nothing lost or doubled
        assert got[0] == LONG[0] and got[1] == LONG[1]  # role chunk and first token are never held
    finally:
        await client.aclose()
        await runner.cleanup()
    # 80 writes 4 ms apart over ~320+ ms: read as they come, about one read per token; held (from
    # the second 50 ms window on), the tokens of each window arrive in one read
    print(f"reads: {reads_free} free, {reads_held} held; pieces {pieces_free} / {pieces_held}")
    assert reads_free >= 50, reads_free
    assert reads_held <= 30, reads_held
    assert pieces_held <= pieces_free + 1


async def test_a_held_stream_ends_within_one_interval_of_its_last_byte_and_a_short_one_at_once():
    runner, url = await _serve(_token_worker(0.1, TOKENS[:6]))  # ~0.6 s: past its first 0.3 s window
    client = UpstreamClient(2.0, 10.0)
    try:
        t0 = time.monotonic()
        got, t_end = await _relay(url, 0.3, True, client)
        assert b"".join(got) == b"".join(TOKENS[:6])
        # the worker is done after ~0.6 s; the end waits at most one 300 ms window (not unbounded)
        assert 0.5 < t_end - t0 < 0.6 + 0.3 + 0.25
    finally:
        await client.aclose()
        await runner.cleanup()
    runner, url = await _serve(_token_worker(0.002, TOKENS[:6]))  # a short reply: done within its first window
    client = UpstreamClient(2.0, 10.0)
    try:
        t0 = time.monotonic()
        got, t_end = await _relay(url, 5.0, True, client)
        assert b"".join(got) == b"".join(TOKENS[:6])
        assert t_end - t0 < 2.5  # not held for the 5 s window: the first one is read as it comes
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_a_connection_broken_while_held_is_an_upstream_error_when_the_interval_ends():
    runner, url = await _serve(_token_worker(0.12, TOKENS[:5], end="drop"))  # dropped in its second 0.2 s window
    client = UpstreamClient(2.0, 10.0)
    try:
        up = await client.open("w", "POST", url + "/x", content=b"{}")
        got = []
        t0 = time.monotonic()
        with pytest.raises(UPSTREAM_ERRORS):
            async for chunk in up.chunks(0.2, hold_reads=True):
                got.append(chunk)
        assert time.monotonic() - t0 < 0.6 + 0.2 + 0.3  # seen when the window ended, not at the read timeout (10 s)
        assert b"".join(got) == b"".join(TOKENS[:5])  # what came before the break is relayed whole
        await up.close()
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_a_client_gone_while_reads_are_held_closes_the_worker_connection():
    closed = asyncio.Event()

    handler = _slow_stream(TOKENS * 20, 0.01, closed)

    runner, url = await _serve(handler)
    client = UpstreamClient(2.0, 10.0)
    try:
        up = await client.open("w", "POST", url + "/x", content=b"{}")
        pieces: list[bytes] = []

        async def consume() -> None:
            try:
                async for chunk in up.chunks(0.5, hold_reads=True):
                    pieces.append(chunk)
            finally:
                await up.close()

        task = asyncio.create_task(consume())
        while len(pieces) < 3:  # the two opening events, then the first window's piece: holding from now on
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # inside the 500 ms hold
        task.cancel()  # what Serve does to the relay when its client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 2.0)  # the worker saw its connection end: SGLang aborts
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_held_streams_above_the_high_water_mark_arrive_whole_and_the_connection_is_reused():
    """The two pauses (batch hold, 1 MiB high-water) do not fight: a stream writing more than the
    buffer bound per window arrives whole, and its connection serves the next request."""
    blob = [bytes([65 + i % 26]) * (256 << 10) + b"\n\n" for i in range(16)]  # 4 MiB in 16 writes
    peers: list[tuple] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for ev in blob:
            await resp.write(ev)
        await resp.write_eof()
        return resp

    runner, url = await _serve(handler)
    client = UpstreamClient(2.0, 10.0)
    try:
        for _ in range(2):
            got, _ = await _relay(url, 0.02, True, client)
            assert b"".join(got) == b"".join(blob)
        assert len(peers) == 2 and peers[0] == peers[1]
    finally:
        await client.aclose()
        await runner.cleanup()


@pytest.mark.parametrize("hold", [False, True])
async def test_concurrent_streams_batched_pieces_leave_together_on_one_clock(hold, monkeypatch):
    """Batch windows end on ticks shared by every stream (`_Ticks`): streams started at different
    moments send their batched pieces right after the same ticks — one timer and one event-loop
    wake-up for all of them, not one per piece — and a piece still waits at most one interval
    after the previous one."""
    from serve_app import proxy

    interval = 0.1
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    tick = proxy._Ticks._tick

    def counting(self):
        fired.append(loop.time())
        tick(self)

    monkeypatch.setattr(proxy._Ticks, "_tick", counting)
    runner, url = await _serve(_token_worker(0.01, TOKENS))  # 30 tokens over ~0.3 s
    client = UpstreamClient(2.0, 10.0)

    async def one(delay: float) -> list[tuple[float, bytes]]:
        await asyncio.sleep(delay)
        up = await client.open("w", "POST", url + "/v1/chat/completions", content=b"{}")
        out = [(loop.time(), c) async for c in up.chunks(interval, hold_reads=hold)]
        await up.close()
        return out

    try:
        t0 = loop.time()
        streams = await asyncio.gather(*(one(0.013 * k) for k in range(5)))
        t1 = loop.time()
    finally:
        await client.aclose()
        await runner.cleanup()
    batched = []
    for pieces in streams:
        assert b"".join(c for _, c in pieces) == b"".join(TOKENS)
        times = [t for t, _ in pieces]
        assert all(b - a <= interval + 0.05 for a, b in zip(times[1:], times[2:]))
        batched += times[2:] if hold else times[2:-1]  # (an end read as it comes leaves at once)
    assert len(batched) >= 10
    assert len(fired) <= (t1 - t0) / interval + 2  # one timer per tick for all five streams
    # every batched piece left in the loop pass after a tick
    assert all(any(0 <= t - f < 0.05 for f in fired) for t in batched)
