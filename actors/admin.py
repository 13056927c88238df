"""Fleet administration at run time: start new workers' actors, stop and forget a worker.

What the router's `/admin/workers` routes call (the router replica does no actor lifecycle of its
own). Blocking Ray calls run in threads: these are awaited from a replica's serving loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from actors.aggregator.actor import get_or_create_aggregator
from actors.fleet import FleetSpec
from actors.models import Settings
from actors.worker.actor import start_worker, stop_workers

READY_SLACK_S = 60.0  # beyond Settings.engine_start_timeout_s: the actor's own start (Ray placement, imports)


class AdminError(RuntimeError):
    """A worker could not be added; its actor (and engine) were stopped again."""

    def __init__(self, worker: str, detail: str) -> None:
        super().__init__(f"worker {worker}: {detail}")
        self.worker = worker


async def add_workers(fleet: FleetSpec, settings: Settings) -> list[dict[str, Any]]:
    """Start every worker of `fleet` and wait until each is ready; on the first failure that
    worker's actor is stopped and `AdminError` raised (the ones before it stay)."""
    added = []
    for spec in fleet.expanded():
        try:
            actor = await asyncio.to_thread(start_worker, spec, settings, detached=True)
            info = await asyncio.wait_for(actor.ready.remote(),
                                          timeout=settings.engine_start_timeout_s + READY_SLACK_S)
        except Exception as exc:
            await asyncio.to_thread(stop_workers, names=[spec.name])
            raise AdminError(spec.name, str(exc).strip().splitlines()[-1][:300]) from None
        added.append({"name": spec.name, "url": info.url, "metrics_endpoint": info.metrics_endpoint})
    return added


async def ensure_workers(fleet: FleetSpec, settings: Settings) -> list[str]:
    """`serve deploy` path: make sure every worker's actor exists (named, detached, get-if-exists:
    idempotent across router replicas and restarts). Returns the names that failed."""
    failed = []
    for spec in fleet.expanded():
        try:
            await asyncio.to_thread(start_worker, spec, settings, detached=True, get_if_exists=True)
        except Exception:
            failed.append(spec.name)
    return failed


async def remove_worker(name: str, settings: Settings) -> bool:
    """Stop the worker's actor (and its managed engine) and drop it from the aggregator's fleet.
    False if no such worker existed."""
    killed = await asyncio.to_thread(stop_workers, names=[name])
    aggregator = await asyncio.to_thread(get_or_create_aggregator, settings)
    removed = await aggregator.remove.remote(name)
    return bool(killed or removed)
