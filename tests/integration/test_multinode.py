"""Placement on a real multi-node Ray (ray.cluster_utils: a head and two GPU-slot nodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "tests.integration.multinode_check", str(free_port())],
                       capture_output=True, text=True, timeout=400, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def test_managed_workers_land_on_the_gpu_slot_nodes_one_each(result):
    nodes = result["nodes"]
    placed = sorted(w["node"] for w in result["workers"].values())
    assert placed == sorted([nodes["a"], nodes["b"]])


def test_each_worker_has_its_own_actor_holding_its_gpu_which_its_engine_sees(result):
    # one WorkerActor per worker, on the node Ray placed it for its num_gpus; the engine it owns sees the
    # GPU Ray assigned to the actor (each node has one: id 0)
    nodes = result["nodes"]
    assert result["worker_actors"] == sorted([["kvroute-worker-gpu-0", result["workers"]["gpu-0"]["node"]],
                                              ["kvroute-worker-gpu-1", result["workers"]["gpu-1"]["node"]]])
    assert sorted(n for _, n in result["worker_actors"]) == sorted([nodes["a"], nodes["b"]])
    assert [w["env"] for w in result["workers"].values()] == ["0", "0"]


def test_router_and_aggregator_run_on_the_head(result):
    assert result["aggregator_node"] == result["nodes"]["head"]
    assert result["router_nodes"] == [result["nodes"]["head"]]


def test_requests_flow_end_to_end_across_nodes(result):
    assert result["before"]["codes"] == [200] * 6
    assert result["before"]["workers"] == ["gpu-0", "gpu-1"]


def test_killing_a_worker_node_marks_its_worker_down_and_routing_continues(result):
    assert result["down_after_s"] < 10
    assert result["after"]["codes"] == [200] * 6
    assert result["victim"] not in result["after"]["workers"]


def test_a_dead_nodes_worker_actor_is_restarted_by_ray_where_a_gpu_is_free_and_serves_again(result):
    assert result["rehomed_actor_nodes"] == [result["nodes"]["c"]]
    assert result["rehomed"]["codes"] == [200] * 6
    assert result["rehomed"]["workers"] == ["gpu-0", "gpu-1"]
