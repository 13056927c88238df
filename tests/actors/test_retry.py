"""actors.transport.retry: the one reconnect-with-back-off helper every follower and pusher uses."""

from __future__ import annotations

import asyncio

import pytest

from actors.transport.retry import Backoff, reconnecting


def test_backoff_doubles_up_to_its_cap_and_reset_starts_over():
    b = Backoff(0.1, 0.5)
    assert [b.delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.delay() == 0.1


@pytest.mark.parametrize("first, cap", [(0, 1), (-1, 1), (0.5, 0.1)])
def test_a_backoff_that_cannot_work_is_refused(first, cap):
    with pytest.raises(ValueError, match="back-off"):
        Backoff(first, cap)


def test_reconnecting_retries_after_each_failure_with_growing_delays_until_done():
    errors: list[str] = []
    calls: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def body() -> bool:
            calls.append(loop.time())
            if len(calls) < 4:
                raise ConnectionError(f"attempt {len(calls)}")
            return True  # done for good

        await asyncio.wait_for(reconnecting(body, Backoff(0.01, 0.04), on_error=lambda e: errors.append(str(e))), 5)

    asyncio.run(main())
    assert errors == ["attempt 1", "attempt 2", "attempt 3"]
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps[0] >= 0.009 and gaps[1] >= 0.019 and gaps[2] >= 0.039  # 0.01, 0.02, 0.04


def test_a_body_that_resets_after_success_retries_at_the_first_delay_again():
    b = Backoff(0.01, 1.0)
    state = {"n": 0}

    async def body() -> bool:
        state["n"] += 1
        if state["n"] == 5:
            return True
        if state["n"] == 3:
            b.reset()  # the connection proved good before it broke again
        raise ConnectionError()

    asyncio.run(asyncio.wait_for(reconnecting(body, b, on_error=lambda e: None), 5))
    assert b.delay() == 0.04  # reset after the 3rd attempt: 0.01 (after 3), 0.02 (after 4), next 0.04


def test_cancelling_a_reconnecting_loop_ends_it_at_once():
    async def main() -> None:
        async def body() -> bool:
            await asyncio.sleep(10)
            return True

        task = asyncio.ensure_future(reconnecting(body, Backoff(0.01, 0.01)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
