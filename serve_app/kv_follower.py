"""Exact prefix mode: follow each KV-event-publishing worker's log (kept by its actor) into an
index of what the engines really hold. Background tasks only; requests read the index."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from actors.protocol import KvLogAnswer
from actors.transport.retry import Backoff, reconnecting
from serve_app.prefix_index import KvEventIndex

logger = logging.getLogger("kvroute.kv_follower")


class KvFollower:
    """One long-poll task per publishing worker: `actor.kv_since(epoch, seq)` → `KvEventIndex`."""

    def __init__(self, index: KvEventIndex, resolve: Callable[[str], Awaitable[Any]], poll_timeout_s: float = 5.0,
                 backoff_s: float = 0.2, backoff_max_s: float | None = None) -> None:
        self.index = index
        self._resolve = resolve
        self.poll_timeout_s = poll_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_s if backoff_max_s is None else backoff_max_s  # None: a fixed delay
        self._tasks: dict[str, asyncio.Task] = {}
        self.synced: set[str] = set()  # workers whose index entries are current (exact overlap applies)
        self.applied_at: dict[str, float] = {}  # worker → when its last answer was applied (time.monotonic)
        self.resyncs = 0

    def ensure(self, worker: str, actor_name: str) -> None:
        if worker not in self._tasks:
            self._tasks[worker] = asyncio.get_running_loop().create_task(self._follow(worker, actor_name))

    def drop(self, worker: str) -> None:
        task = self._tasks.pop(worker, None)
        if task is not None:
            task.cancel()
        self.synced.discard(worker)
        self.applied_at.pop(worker, None)
        self.index.remove_worker(worker)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def apply(self, worker: str, answer: KvLogAnswer) -> None:
        """Merge one `kv_since` answer (pure; used by the task and by tests)."""
        if answer.full:
            self.index.clear(worker)
            self.resyncs += 1
        for entry in answer.entries:
            self.index.apply(worker, entry.events, entry.rank)
        self.applied_at[worker] = time.monotonic()

    async def _follow(self, worker: str, actor_name: str) -> None:
        backoff = Backoff(self.backoff_s, self.backoff_max_s)

        async def follow() -> bool:
            """Long polls on the worker's actor, from a fresh cursor; True: it publishes no KV events."""
            actor = await self._resolve(actor_name)
            epoch: str | None = None
            seq = 0
            while True:
                # `worker`: a host serves the KV logs of all the workers it hosts (an own actor ignores it)
                answer: KvLogAnswer | None = await actor.kv_since.remote(epoch, seq, self.poll_timeout_s,
                                                                         worker=worker)
                if answer is None:
                    return True
                self.apply(worker, answer)
                epoch, seq = answer.epoch, answer.seq
                self.synced.add(worker)
                backoff.reset()

        def lost(exc: Exception) -> None:  # actor restarting or gone: stop claiming, resync when back
            logger.info("worker %s: KV event follow failed (%s); resyncing", worker, type(exc).__name__)
            self.synced.discard(worker)
            self.index.clear(worker)

        await reconnecting(follow, backoff, on_error=lost)
