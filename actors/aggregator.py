"""The singleton aggregator actor: soft state filled by worker actors, long-polled by routers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from actors.models import Settings
from actors.registry import FleetRegistry

logger = logging.getLogger("kvroute.aggregator")

AGGREGATOR_NAME = "kvroute-aggregator"
NAMESPACE = "kvroute"


# max_task_retries=-1: calls made while Ray restarts it wait for the new incarnation instead of
# failing (every method is idempotent), so pushes and long polls resume the moment it is back.
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Aggregator:
    """Named, detached, restartable. Holds only soft state: after a restart the workers'
    heartbeats (≤ `heartbeat_s`) make it whole again, and the new epoch tells routers to resync."""

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        self._registry = FleetRegistry(Settings.model_validate(settings or {}))
        self._changed = asyncio.Event()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        logger.info("aggregator up, epoch %s", self._registry.epoch)

    @ray.method(enable_task_events=False)  # hot path: skip Ray's per-call task events
    async def report(self, batch: dict[str, Any]) -> str:
        """One worker actor's batched report. Returns the registry epoch."""
        if self._registry.report(batch):
            self._notify()
        return self._registry.epoch

    @ray.method(enable_task_events=False)  # hot path: skip Ray's per-call task events
    async def report_in_flight(self, replica: str, counts: dict[str, int]) -> str:
        if self._registry.report_in_flight(replica, counts):
            self._notify()
        return self._registry.epoch

    async def remove(self, name: str) -> bool:
        removed = self._registry.remove(name)
        if removed:
            logger.info("worker %s removed", name)
            self._notify()
        return removed

    @ray.method(enable_task_events=False)  # hot path: skip Ray's per-call task events
    async def snapshot(
        self, since_version: int = 0, epoch: str | None = None, timeout_s: float = 5.0
    ) -> dict[str, Any]:
        """Long poll: answers at once if something changed after `since_version` (or the epoch
        differs), else when something changes or after `timeout_s` with an empty delta."""
        reg = self._registry
        if epoch == reg.epoch and since_version >= reg.version:
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                pass
        return reg.delta(since_version, epoch)

    async def names(self) -> list[str]:
        return self._registry.names()

    @ray.method(enable_task_events=False)  # hot path: skip Ray's per-call task events
    async def ping(self) -> str:
        return self._registry.epoch

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _tick_loop(self) -> None:
        period = self._registry.settings.state_tick_s
        while True:
            await asyncio.sleep(period)
            try:
                if self._registry.tick():
                    self._notify()
            except Exception:  # never let the ticker die silently
                logger.exception("state tick failed")


def aggregator_options(settings: Settings, resources: dict[str, float] | None = None) -> dict[str, Any]:
    return {
        "name": AGGREGATOR_NAME,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "resources": resources if resources is not None else dict(settings.aggregator_resources),
    }


def get_or_create_aggregator(
    settings: Settings | None = None, resources: dict[str, float] | None = None
) -> Any:
    """The singleton's handle, creating it if absent (idempotent across callers). Blocking call:
    from an async actor run it in a thread (`asyncio.to_thread`)."""
    settings = settings or Settings()
    return Aggregator.options(**aggregator_options(settings, resources)).remote(settings.model_dump())


def kill_aggregator() -> bool:
    """Tear the detached singleton down (it outlives Serve otherwise). True if one existed."""
    try:
        handle = ray.get_actor(AGGREGATOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True
