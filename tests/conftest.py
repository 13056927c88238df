"""Shared fixtures: one local Ray cluster per test session (integration tests only).

Lanes: `tests/{actors,serve_app,sim,bench}` mirror the packages and never start Ray; everything
under `tests/integration` and `tests/e2e` is marked `ray` here, so `pytest -m "not ray"` is the
fast lane and `pytest` the whole suite.
"""

from __future__ import annotations

import os

import pytest

from actors.ports import free_port  # noqa: F401  (the tests' port picker)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


_RAY_DIRS = ("integration", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in _RAY_DIRS:
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session (ray.init ≈ 3 s here; never per test)."""
    import ray

    if not ray.is_initialized():
        from serve_app.ray_env import apply_serve_env

        from actors.models import NAMESPACE

        apply_serve_env()  # the Serve transport kvroute runs with
        # sized for CI's 2 cores: every kvroute actor and Serve replica asks for 0 CPUs, so the
        # logical CPUs only bound Ray's pool of prestarted idle workers (each a ~100 MB process)
        # address="local": a Ray of this session's own, even if another program's cluster (`ray start`,
        # ray.cluster_utils) left its address in /tmp/ray, where a bare ray.init() would join it
        ray.init(address="local", num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="module")
def agg(ray_cluster):
    """kvroute's aggregator actor on the session's Ray (created on demand, as `kvroute serve` does)."""
    import ray

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.models import Settings

    a = get_or_create_aggregator(Settings())
    ray.get(a.ping.remote(), timeout=30)
    return a
