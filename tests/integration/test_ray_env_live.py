"""The local Ray kvroute starts runs its processes at the router's priority, not Ray's background one.

Ray starts worker processes at nice 15 by default (`worker_niceness`): on a busy machine the router
replica, HAProxy, the metrics plane and the engines they launch then lose the CPU to any nice-0
process — measured here: a 4-worker Mooncake replay at 24 req/s with other jobs using ~1.5 cores
failed 620 of 841 kv_aware requests at nice 15 and none at nice 0 (bench/results/mooncake.md).
"""

from __future__ import annotations

import os


def test_ray_workers_of_a_local_ray_run_at_nice_zero(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    @ray.remote(num_cpus=0)
    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    assert ray.get(niceness.remote(), timeout=60) == 0
    p = Probe.remote()
    try:
        assert ray.get(p.niceness.remote(), timeout=60) == 0
    finally:
        ray.kill(p)
