"""EngineDriver: the engine in scaled real time, as the HTTP server runs it (no HTTP here)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sim.config import EngineConfig
from sim.engine import Engine
from sim.server import EngineDown, EngineDriver

FAST = dict(prefill_base_s=0.05, prefill_per_token_s=0.0, decode_base_s=0.05, decode_per_req_s=0.0,
            decode_per_kv_token_s=0.0)


async def test_tokens_arrive_in_order_at_the_scaled_pace():
    driver = EngineDriver(Engine(EngineConfig(**FAST)), time_scale=0.2)  # 50 ms sim = 10 ms wall
    task = asyncio.create_task(driver.run())
    t0 = time.monotonic()
    stream = driver.submit("a", [1, 2, 3], 5)  # prefill + 4 decode steps = 250 ms sim = 50 ms wall
    outs = [await asyncio.wait_for(stream.queue.get(), 2) for _ in range(5)]
    elapsed = time.monotonic() - t0
    assert [o.index for o in outs] == [0, 1, 2, 3, 4] and outs[-1].finished
    assert 0.045 <= elapsed < 0.5
    assert stream.req.ttft == pytest.approx(0.05, abs=0.03)
    driver.stop()
    await task


async def test_an_engine_failure_fails_open_requests_and_refuses_new_ones():
    engine = Engine(EngineConfig(**FAST))
    driver = EngineDriver(engine, time_scale=0.1)

    def broken(now):
        raise RuntimeError("boom")

    engine.schedule = broken  # type: ignore[method-assign]
    task = asyncio.create_task(driver.run())
    stream = driver.submit("a", [1, 2], 3)
    out = await asyncio.wait_for(stream.queue.get(), 2)
    assert out.finished and out.finish_reason == "abort"
    await task
    assert isinstance(driver.failed, RuntimeError)
    with pytest.raises(EngineDown):
        driver.submit("b", [1], 1)
