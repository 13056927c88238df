"""Peer sharing: this replica's in-flight counts reach the other router replicas.

Batched like the metrics: every few push intervals, and only when the counts changed (or a
heartbeat is due), the counts go over the aggregator's ZeroMQ ingest as worker reports do — no
Ray call per share. The aggregator publishes them to every follower in its fleet deltas. An
unreachable aggregator is retried through `actors.transport.retry.reconnecting`; the counts are resent when
it is back.

Sharing at the fast cadence is for replicas that route side by side. Without a peer (the
aggregator's deltas name the sharing replicas: `FleetFollower.replicas`), a replica only announces
itself, with empty counts, once per heartbeat (and its loop wakes only for that and, every half
heartbeat, to look for an active peer): under load its counts change at every interval, and
each share would otherwise cost the aggregator and every follower a delta that nobody reads. With
peers that all have been idle for `down_after_s` (no counts of theirs in the fleet view), it sends
its counts once per heartbeat — enough for them to see it is busy. Once a peer has requests in
flight too (it saw ours, or it started routing), both share at every change. A second replica
therefore turns fast sharing on within about one heartbeat of its first requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from actors.transport.link import AggregatorLink
from actors.models import Settings
from actors.transport.retry import Backoff, reconnecting
from serve_app.router import RouterCore

logger = logging.getLogger("kvroute.router")


async def share_in_flight(core: RouterCore, replica_id: str, resolve_aggregator: Callable[[], Awaitable[Any]],
                          settings: Settings) -> None:
    """Run until cancelled."""
    last: dict[str, int] | None = None
    last_sent = 0.0
    backoff = Backoff(settings.reconnect_backoff_s, settings.reconnect_backoff_max_s)
    link = AggregatorLink(resolve_aggregator, hwm=2, backoff_s=settings.reconnect_backoff_s,
                          backoff_max_s=settings.reconnect_backoff_max_s)

    fast = settings.push_interval_s * 5
    idle_poll = max(fast, settings.heartbeat_s / 2)
    active = False

    async def share() -> bool:
        nonlocal last, last_sent, active
        while True:
            # beside an active peer: every `fast` interval; otherwise only a heartbeat can be due —
            # wake for it, and every half heartbeat to notice a peer that became active (each
            # wake-up of an idle event loop costs the kernel's sleep and wake-up: ~0.1 ms of CPU on
            # a small VM, 20 a second at the fast cadence)
            due = last_sent + settings.heartbeat_s - time.monotonic()
            await asyncio.sleep(fast if active else max(fast, min(idle_poll, due)))
            present, active = core.peers(settings.down_after_s)
            now = time.monotonic()
            heartbeat = now - last_sent >= settings.heartbeat_s
            if not (active or heartbeat):
                continue
            counts = core.in_flight_share()
            if not present:
                counts = {}  # alone: an announcement (nobody reads our counts)
            if (active and counts != last) or heartbeat:
                if await link.ensure() and link.push_in_flight(replica_id, counts):
                    last, last_sent = counts, now
                    backoff.reset()

    try:
        await reconnecting(share, backoff, on_error=lambda exc: logger.debug("in-flight share failed: %s", exc),
                           what="in-flight share")
    finally:
        link.close()
