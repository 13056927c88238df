"""bench.hop: a reply's first token is the first read carrying generated text, whatever arrives with it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

import httpx
from aiohttp import web

from bench.hop import _background, _has_text, _one


def _event(delta: dict | None, usage: bool = False) -> bytes:
    body = {"choices": [] if delta is None else [{"index": 0, "delta": delta}]}
    if usage:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def _serving(handler) -> AsyncIterator[str]:
    """`handler` as POST /v1/chat/completions on a loopback port; yields its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        await runner.cleanup()


def test_only_events_with_generated_text_count():
    assert _has_text(_event({"content": "hi"}).rstrip())
    assert not _has_text(_event({"role": "assistant", "content": ""}).rstrip())
    assert not _has_text(_event(None, usage=True).rstrip())
    assert not _has_text(b"data: [DONE]")
    assert not _has_text(b'data: {"choices": [{"delta": {"content": "cut')  # half an event


async def test_role_and_first_token_in_one_read_is_the_first_token_even_split_across_reads():
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = _event({"role": "assistant", "content": ""}) + _event({"content": "a"})
        await resp.write(first[:-10])  # the first token's event split across two reads
        await asyncio.sleep(0.01)
        await resp.write(first[-10:])
        await asyncio.sleep(0.3)
        await resp.write(_event({"content": "b"}) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with _serving(stream) as url:
        async with httpx.AsyncClient(timeout=10) as c:
            first, end, reads = await _one(c, url, "m", 2, 0)
    assert first < 200, first  # not the later token 300 ms on
    assert end >= 300, end
    assert reads >= 2


async def test_background_load_is_open_loop_and_every_stream_is_read_to_its_end():
    seen: list[dict] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.2)  # slower than the arrivals: requests overlap (not closed loop)
        await resp.write(_event({"content": "a"}) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    stop, done = asyncio.Event(), [0]
    async with _serving(stream) as url:
        task = asyncio.create_task(_background(url, "m", 50.0, stop, done))
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert 20 <= len(seen) <= 100, len(seen)  # ~50 at 50 req/s for 1 s, whatever each one takes
    assert done[0] == len(seen)  # every stream was read to its end before it returned
    assert all(b["stream"] and b["max_tokens"] == 32 and b["model"] == "m" for b in seen)
