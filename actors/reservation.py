"""Ray resources for a hosted managed engine: one placement group per worker holds what its spec asks
for (`num_gpus`, `num_cpus`, `resources`), so Ray's accounting keeps other work off them, without a
Ray process per worker — the engine itself runs under its node's host (`actors.hosting`).

Ray tells which GPUs a bundle holds only to work running in it: `reserve` runs one zero-CPU task in
the bundle asking for the bundle's GPUs and reads `get_accelerator_ids()` there; the engine gets them
as `CUDA_VISIBLE_DEVICES`. The group is named after the worker (`kvroute-engine-<name>`), detached
(it outlives the caller), and pinned to `spec.node_id` when given (the node-id label). `release`
removes it; the hosts call it when a worker is removed, `stop_workers` for all of kvroute's.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import ray
from ray.util.placement_group import get_placement_group, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.fleet import WorkerSpec
from actors.hosting import needs_reservation

logger = logging.getLogger("kvroute.reservation")

PG_PREFIX = "kvroute-engine-"
NODE_LABEL = "ray.io/node-id"


class ReservationError(RuntimeError):
    """A worker's resources could not be reserved (no node has them free in time)."""


class Reservation(msgspec.Struct, frozen=True):
    """What Ray holds for one hosted managed engine: its placement group, the node, the GPUs."""

    group: str
    node_id: str
    gpu_ids: list[str]

    def env(self) -> dict[str, str]:
        """The engine's environment for them (its GPUs; none: unchanged)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids)} if self.gpu_ids else {}


def bundle(spec: WorkerSpec) -> dict[str, float]:
    out = {k: float(v) for k, v in spec.resources.items() if v}
    if spec.num_gpus:
        out["GPU"] = float(spec.num_gpus)
    if spec.num_cpus:
        out["CPU"] = float(spec.num_cpus)
    return out


def group_name(worker: str) -> str:
    return f"{PG_PREFIX}{worker}"


@ray.remote(num_cpus=0)
def _accelerators() -> list[str]:
    return [str(x) for x in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def _existing(name: str) -> Any:
    try:
        return get_placement_group(name)
    except ValueError:
        return None


def reserve(spec: WorkerSpec, timeout_s: float = 60.0) -> Reservation:
    """Reserve `spec`'s resources (its existing group if one is already named after it). Raises
    ReservationError if no node has them free within `timeout_s` (the group is removed again)."""
    want = bundle(spec)
    name = group_name(spec.name)
    pg = _existing(name)
    if pg is None:
        kw: dict[str, Any] = {}
        if spec.node_id:
            kw["bundle_label_selector"] = [{NODE_LABEL: spec.node_id}]
        try:
            pg = placement_group([want], strategy="STRICT_PACK", name=name, lifetime="detached", **kw)
        except Exception:  # another router replica created it meanwhile (serve deploy's get-if-exists path)
            pg = _existing(name)
            if pg is None:
                raise
    if not pg.wait(timeout_seconds=max(1, int(timeout_s))):
        other = _existing(name)
        if other is not None and other.id != pg.id and other.wait(timeout_seconds=1):
            pg = other  # ours lost a creation race to a twin; use the one that won
        else:
            remove_placement_group(pg)
            where = f"node {spec.node_id}" if spec.node_id else "any node"
            raise ReservationError(f"worker {spec.name}: cannot reserve {want} on {where} within {timeout_s:.0f} s (no "
                                   "node has them free: `ray status` shows what is)")
    node = placement_group_table(pg)["bundles_to_node_id"][0]
    gpu_ids: list[str] = []
    if spec.num_gpus:
        probe = _accelerators.options(num_gpus=spec.num_gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0))
        gpu_ids = ray.get(probe.remote(), timeout=timeout_s)
    logger.info("worker %s: reserved %s on node %s (GPUs %s)", spec.name, want, node, gpu_ids or "none")
    return Reservation(name, node, gpu_ids)


def release(worker: str) -> bool:
    """Remove the group named after `worker`; False if there was none."""
    try:
        pg = get_placement_group(group_name(worker))
    except ValueError:
        return False
    remove_placement_group(pg)
    return True


def release_all() -> list[str]:
    """Remove every kvroute engine group (alive or pending); returns the worker names."""
    out = []
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(PG_PREFIX) and info.get("state") != "REMOVED":
            if release(name[len(PG_PREFIX):]):
                out.append(name[len(PG_PREFIX):])
    return out


__all__ = ["Reservation", "ReservationError", "bundle", "needs_reservation", "release", "release_all",
           "reserve"]
