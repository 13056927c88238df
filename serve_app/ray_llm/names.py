"""The one mapping between a Serve replica and its kvroute worker name (no Ray import).

The `server_cls` registers its replica under this name and the request router looks candidates
up by it, so both sides must agree; it keeps app and deployment so that several SGLang
deployments can share one aggregator without clashing.
"""

from __future__ import annotations

from typing import Any

WORKER_PREFIX = "serve:"
# a replica in front of a worker with another name says which in Serve's routing stats (`record_routing_stats`)
ROUTING_STATS_KEY = "kvroute_worker"


def worker_name(app: str, deployment: str, unique_id: str) -> str:
    """`serve:<app>/<deployment>/<replica unique id>` — stable for the replica's lifetime."""
    return f"{WORKER_PREFIX}{app}/{deployment}/{unique_id}"


def replica_worker_name(replica_id: Any) -> str:
    """The worker name of a Serve `ReplicaID` (duck-typed: `deployment_id.app_name`, `.name`, `unique_id`)."""
    d = replica_id.deployment_id
    return worker_name(d.app_name or "", d.name, replica_id.unique_id)
