"""The real-engine lane: SGLang 0.5.23's own server on CPU (tests/real_engine, `pytest -m real_engine`
in the venv of scripts/sglang_env.sh 0.5.23; docs/real-engine.md). Every test here is marked
`real_engine`; outside that venv each module skips (no sglang / torch)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "real_engine" in item.path.parts:
            item.add_marker(pytest.mark.real_engine)


@pytest.fixture(scope="session")
def lane_root():
    """One directory per lane run for engines' logs, sockets and fleet files (kept after the run:
    the logs are what to read when a test fails; pytest's own basetemp is pruned by other runs)."""
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="kvroute-real-engine-"))
    print(f"real-engine lane: logs in {root}")
    return root


@pytest.fixture(scope="module")
def workdir(lane_root):
    def make(name: str):
        d = lane_root / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    return make


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The lane's tiny model (tests/real_engine/tiny_model.py), made once per session."""
    from tests.real_engine import tiny_model

    return tiny_model.ensure(tmp_path_factory.mktemp("tiny-model"))
