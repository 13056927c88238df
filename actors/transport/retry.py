"""Reconnect with back-off, written once: every loop that follows or pushes to another process
(the aggregator link, the fleet follower, the KV-log follower, a router replica's in-flight share)
retries through `Backoff` and, when it is a loop, `reconnecting`. No Ray import."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

logger = logging.getLogger("kvroute.retry")


class Backoff:
    """Delays that double from `first_s` up to `max_s`; `reset()` after a success.

    `delay()` hands out the next delay (and doubles it); `sleep()` waits it."""

    __slots__ = ("first_s", "max_s", "_next")

    def __init__(self, first_s: float, max_s: float) -> None:
        if first_s <= 0 or max_s < first_s:
            raise ValueError(f"back-off needs 0 < first_s <= max_s (got {first_s}, {max_s})")
        self.first_s, self.max_s = first_s, max_s
        self._next = first_s

    def delay(self) -> float:
        d = self._next
        self._next = min(d * 2, self.max_s)
        return d

    def reset(self) -> None:
        self._next = self.first_s

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay())


async def reconnecting(
    body: Callable[[], Awaitable[bool | None]],
    backoff: Backoff,
    *,
    on_error: Callable[[Exception], None] | None = None,
    what: str = "connection",
) -> None:
    """Run `body` until it returns True (done for good): whenever it raises — the peer restarted,
    moved or went silent — call `on_error` (drop what the failed connection held), wait the next
    back-off and run it again. `body` calls `backoff.reset()` once its connection proved good
    (e.g. a first answer arrived). Cancellation ends the loop at once."""
    while True:
        try:
            if await body():
                return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if on_error is not None:
                on_error(exc)
            else:
                logger.info("%s failed (%s: %s); retrying", what, type(exc).__name__, str(exc)[:200])
            await backoff.sleep()
            continue
        await backoff.sleep()  # returned without being done (e.g. a clean end of stream): reconnect too
