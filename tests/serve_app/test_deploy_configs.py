"""The shipped deployment files pass the checks `ray up` / `serve deploy` / KubeRay would apply
(offline, no cluster), and the checks catch the mistakes Ray itself lets through."""

from __future__ import annotations

import ast
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from actors.fleet import load_fleet
from serve_app.deploy_check import (
    HEAD_RESOURCE,
    KVROUTE_IMPORT_PATH,
    SLOT_RESOURCE,
    DeployCheckError,
    check_cluster_config,
    check_cluster_yaml,
    check_placement,
    check_rayservice,
    check_serve_config,
    main,
    node_groups_of_cluster,
)
from serve_app.config import DEPLOYMENT_NAME as ROUTER_DEPLOYMENT

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster.yaml"
SERVE = ROOT / "deploy" / "serve_config.yaml"
RAYSERVICE = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


@pytest.fixture(scope="module")
def cluster_raw() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


@pytest.fixture(scope="module")
def prepared(cluster_raw) -> dict:
    return check_cluster_config(copy.deepcopy(cluster_raw), "cluster.yaml")


@pytest.fixture
def serve_raw() -> dict:
    return yaml.safe_load(SERVE.read_text())


@pytest.fixture
def rayservice_docs() -> list:
    return list(yaml.safe_load_all(RAYSERVICE.read_text()))


def _errors(fn, *args) -> str:
    with pytest.raises(DeployCheckError) as exc:
        fn(*args)
    return "\n".join(exc.value.errors)


def _router(cfg: dict) -> dict:
    return next(d for d in cfg["applications"][0]["deployments"] if d["name"] == ROUTER_DEPLOYMENT)


# ------------------------------------------------------------------ cluster.yaml


def test_cluster_yaml_passes_the_validation_ray_up_runs_before_any_cloud_call(cluster_raw):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = check_cluster_yaml(CLUSTER)
    validate_config(prepare_config(copy.deepcopy(cluster_raw)))  # Ray's own calls, unwrapped
    # prepare_config merged the (empty) common setup commands into each role's list
    assert any("sglang==" in c for c in prepared["worker_setup_commands"])
    assert not any("sglang" in c for c in prepared["head_setup_commands"])


def test_cluster_head_alone_offers_the_router_resource_and_gpu_nodes_offer_engine_slots(prepared):
    groups = {g.name: g for g in node_groups_of_cluster(prepared)}
    head = next(g for g in groups.values() if g.head)
    workers = [g for g in groups.values() if not g.head]
    assert head.resources[HEAD_RESOURCE] >= 1 and SLOT_RESOURCE not in head.resources
    assert "GPU" not in head.resources
    assert all(HEAD_RESOURCE not in g.resources for g in workers)
    engine_types = [g for g in workers if g.resources.get(SLOT_RESOURCE, 0) > 0]
    assert engine_types and all(g.resources["GPU"] >= 1 and g.max_count > 0 for g in engine_types)
    assert prepared["available_node_types"][engine_types[0].name]["min_workers"] == 0


def test_cluster_typo_in_a_key_is_rejected_by_rays_schema(cluster_raw):
    bad = copy.deepcopy(cluster_raw)
    gpu = bad["available_node_types"]["gpu_a10g"]
    gpu["max_worker"] = gpu.pop("max_workers")
    msg = _errors(check_cluster_config, bad, "typo.yaml")
    assert "available_node_types.gpu_a10g" in msg and "'max_worker' was unexpected" in msg
    assert "did you mean 'max_workers'" in msg


def test_cluster_wrong_type_is_rejected_by_rays_schema(cluster_raw):
    bad = copy.deepcopy(cluster_raw)
    bad["max_workers"] = "eight"
    assert "max_workers: 'eight' is not of type 'integer'" in _errors(check_cluster_config, bad)


def test_cluster_min_workers_above_global_max_is_rejected_by_rays_validate_config(cluster_raw):
    bad = copy.deepcopy(cluster_raw)
    bad["available_node_types"]["gpu_a10g"]["min_workers"] = bad["max_workers"] + 1
    assert "sum of `min_workers`" in _errors(check_cluster_config, bad)


def test_cluster_without_the_head_resource_is_rejected(cluster_raw):
    bad = copy.deepcopy(cluster_raw)
    del bad["available_node_types"]["head_cpu"]["resources"][HEAD_RESOURCE]
    assert f"the head must expose {HEAD_RESOURCE}" in _errors(check_cluster_config, bad)


def test_cluster_start_command_resources_that_disagree_with_the_node_type_are_rejected(cluster_raw):
    bad = copy.deepcopy(cluster_raw)
    bad["worker_start_ray_commands"][-1] += """ --resources='{"sglang_slot": 2}'"""
    msg = _errors(check_cluster_config, bad)
    assert "worker_start_ray_commands" in msg and "gpu_a10g" in msg
    good = copy.deepcopy(cluster_raw)
    good["worker_start_ray_commands"][-1] += """ --resources='{"sglang_slot": 1}'"""
    check_cluster_config(good)


def test_cluster_images_must_match_the_installed_ray_and_have_cuda_on_gpu_nodes(cluster_raw):
    bad = copy.deepcopy(cluster_raw)
    bad["docker"]["head_image"] = "rayproject/ray:2.59.0-py311-cpu"
    bad["docker"]["worker_image"] = "rayproject/ray:2.60.0-py311-cpu"
    msg = _errors(check_cluster_config, bad)
    assert "2.59.0-py311-cpu does not match" in msg
    assert "has no CUDA" in msg


# ------------------------------------------------------------------ serve_config.yaml


def test_serve_config_is_a_valid_deploy_schema_for_kvroutes_router(serve_raw):
    schema = check_serve_config(serve_raw, "serve_config.yaml")
    (app,) = schema.applications
    assert app.import_path == KVROUTE_IMPORT_PATH
    (dep,) = app.deployments
    assert dep.name == ROUTER_DEPLOYMENT
    assert dep.max_ongoing_requests >= 256  # Serve's default of 5 would queue the 6th stream
    assert dep.ray_actor_options.resources == {HEAD_RESOURCE: 1}
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8000)


def test_serve_schema_alone_silently_drops_unknown_keys(serve_raw):
    """Why check_serve_config exists: Ray accepts a misspelt option and deploys without it."""
    from ray.serve.schema import ServeDeploySchema

    _router(serve_raw)["max_ongoing_request"] = _router(serve_raw).pop("max_ongoing_requests")
    dep = ServeDeploySchema.model_validate(serve_raw).applications[0].deployments[0]
    assert "max_ongoing_requests" not in dep.model_fields_set


def test_unknown_deployment_key_is_rejected_with_a_suggestion(serve_raw):
    _router(serve_raw)["max_ongoing_request"] = _router(serve_raw).pop("max_ongoing_requests")
    msg = _errors(check_serve_config, serve_raw)
    assert "applications[0] (name 'kvroute').deployments[0] (name 'KvRouter').max_ongoing_request" in msg
    assert "did you mean 'max_ongoing_requests'" in msg


def test_unknown_keys_are_found_at_every_depth(serve_raw):
    serve_raw["http_options"]["hots"] = "127.0.0.1"
    _router(serve_raw)["autoscaling_config"]["max_replica"] = 8
    _router(serve_raw)["ray_actor_options"]["num_cpu"] = 2
    msg = _errors(check_serve_config, serve_raw)
    for key in ("http_options.hots", "autoscaling_config.max_replica", "ray_actor_options.num_cpu"):
        assert key in msg


def test_bad_app_args_key_is_rejected_by_appargs(serve_raw):
    router = serve_raw["applications"][0]["args"]["router"]
    router["polcy"] = router.pop("policy")
    msg = _errors(check_serve_config, serve_raw)
    assert "applications[0] (name 'kvroute').args.router.polcy: Extra inputs are not permitted" in msg


def test_unknown_policy_name_is_rejected(serve_raw):
    serve_raw["applications"][0]["args"]["router"]["policy"] = "kv_awre"
    errors = _errors(check_serve_config, serve_raw)
    assert "unknown policy 'kv_awre' (did you mean 'kv_aware'?)" in errors and "args.router.policy" in errors


def test_autoscaling_config_values_are_validated_although_serve_defers_them(serve_raw):
    auto = _router(serve_raw)["autoscaling_config"]
    auto["min_replicas"], auto["max_replicas"] = 5, 2
    assert "autoscaling_config" in _errors(check_serve_config, serve_raw)


def test_max_ongoing_requests_below_the_autoscaling_target_is_rejected(serve_raw):
    _router(serve_raw)["max_ongoing_requests"] = 100  # target is 256: never reached
    assert "autoscaling never scales up" in _errors(check_serve_config, serve_raw)


def test_autoscaling_without_num_replicas_auto_is_rejected(serve_raw):
    del _router(serve_raw)["num_replicas"]  # build_app would pin args.router.num_replicas = 1
    assert "set num_replicas: auto" in _errors(check_serve_config, serve_raw)


def test_override_of_a_deployment_kvroute_does_not_have_is_rejected(serve_raw):
    _router(serve_raw)["name"] = "Router"
    assert "one deployment, 'KvRouter'" in _errors(check_serve_config, serve_raw)


def test_router_deployment_name_matches_the_app(serve_raw):
    # read from the source: importing serve_app.app would start pulling in all of Serve's glue.
    # The app takes serve_app.config.DEPLOYMENT_NAME (or, until it imports it, spells the same name).
    tree = ast.parse((ROOT / "serve_app" / "app.py").read_text())
    imported = any(
        isinstance(node, ast.ImportFrom) and node.module == "serve_app.config"
        and "DEPLOYMENT_NAME" in [a.name for a in node.names] for node in tree.body
    )
    literals = [
        node.value.value for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DEPLOYMENT_NAME"]
    ]
    assert imported != bool(literals), "serve_app.app must take DEPLOYMENT_NAME from serve_app.config, once"
    assert all(name == ROUTER_DEPLOYMENT for name in literals)
    assert ROUTER_DEPLOYMENT == _router(serve_raw)["name"]


def test_serve_config_fits_the_cluster_and_too_many_router_replicas_do_not(serve_raw, prepared):
    groups = node_groups_of_cluster(prepared)
    assert check_placement(check_serve_config(serve_raw), groups) == []
    _router(serve_raw)["autoscaling_config"]["max_replicas"] = 100
    problems = "\n".join(check_placement(check_serve_config(serve_raw), groups))
    assert "100 replicas x kvroute_head=1 + aggregator 1 exceed the 100" in problems
    assert "100 replicas x CPU=1 exceed the 8" in problems


def test_serve_configs_fleet_path_is_a_file_cluster_yaml_mounts(serve_raw, cluster_raw):
    fleet = serve_raw["applications"][0]["args"]["fleet"]
    home = "/home/ray/"  # the rayproject/ray images' user; "~" in file_mounts expands to it
    for remote, local in cluster_raw["file_mounts"].items():
        remote = remote.replace("~/", home)
        if fleet.startswith(remote.rstrip("/") + "/"):
            local_file = ROOT / local / fleet[len(remote.rstrip("/")) + 1:]
            break
    else:
        pytest.fail(f"{fleet} is not under any file_mounts target of cluster.yaml")
    assert load_fleet(local_file).workers


# ------------------------------------------------------------------ rayservice.yaml


def test_rayservice_is_valid_and_carries_the_same_serve_config_and_fleet(rayservice_docs, serve_raw):
    svc = check_rayservice(rayservice_docs, "rayservice.yaml")
    assert svc["apiVersion"] == "ray.io/v1"
    assert yaml.safe_load(svc["spec"]["serveConfigV2"]) == serve_raw
    (cm,) = [d for d in rayservice_docs if d["kind"] == "ConfigMap"]
    assert yaml.safe_load(cm["data"]["fleet-cluster.yaml"]) == yaml.safe_load(
        (ROOT / "examples" / "fleet-cluster.yaml").read_text()
    )
    fleet_path = serve_raw["applications"][0]["args"]["fleet"]
    cluster = svc["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:  # the fleet file is wherever the app builder or a worker actor runs
        mounts = pod["template"]["spec"]["containers"][0]["volumeMounts"]
        assert any(m["mountPath"] == fleet_path for m in mounts)


def test_rayservice_groups_expose_the_custom_resources(rayservice_docs):
    cluster = check_rayservice(rayservice_docs)["spec"]["rayClusterConfig"]
    assert HEAD_RESOURCE in cluster["headGroupSpec"]["rayStartParams"]["resources"]
    (gpu,) = cluster["workerGroupSpecs"]
    assert SLOT_RESOURCE in gpu["rayStartParams"]["resources"]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpu["minReplicas"] == 0 and gpu["maxReplicas"] > 0


def test_rayservice_serve_config_goes_through_the_same_unknown_key_check(rayservice_docs):
    svc = next(d for d in rayservice_docs if d["kind"] == "RayService")
    svc["spec"]["serveConfigV2"] = svc["spec"]["serveConfigV2"].replace(
        "max_ongoing_requests:", "max_ongoing_request:"
    )
    assert "spec.serveConfigV2: applications[0]" in _errors(check_rayservice, rayservice_docs)


def test_rayservice_start_params_must_be_strings(rayservice_docs):
    svc = next(d for d in rayservice_docs if d["kind"] == "RayService")
    svc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 8
    assert "rayStartParams.num-cpus: must be a string" in _errors(check_rayservice, rayservice_docs)


def test_rayservice_with_an_invalid_fleet_configmap_is_rejected(rayservice_docs):
    cm = next(d for d in rayservice_docs if d["kind"] == "ConfigMap")
    cm["data"]["fleet-cluster.yaml"] = cm["data"]["fleet-cluster.yaml"].replace("engine: sglang", "engine: vllm")
    assert "engine" in _errors(check_rayservice, rayservice_docs)


# ------------------------------------------------------------------ example fleets


def test_attach_example_names_two_local_workers_with_their_metrics_endpoints():
    fleet = load_fleet(ROOT / "examples" / "fleet.yaml")
    assert [(w.url, w.metrics_endpoint) for w in fleet.workers] == [
        ("http://127.0.0.1:30001", "ipc:///tmp/kvroute-w1.metrics"),
        ("http://127.0.0.1:30002", "ipc:///tmp/kvroute-w2.metrics"),
    ]
    assert not any(w.managed for w in fleet.workers)


def test_sim_example_launches_simulated_workers_and_sets_its_router():
    from serve_app.config import load_config

    fleet = load_config(ROOT / "examples" / "fleet-sim.yaml")  # kvroute serve reads the whole tree
    assert {w.engine for w in fleet.workers} == {"sim"} and len(fleet.expanded()) >= 2
    assert fleet.router.block_size == fleet.workers[0].page_size


def test_cluster_fleet_fits_the_gpu_node_type_it_asks_for(prepared):
    fleet = load_fleet(ROOT / "examples" / "fleet-cluster.yaml")
    workers = fleet.expanded()
    assert all(w.engine == "sglang" and w.resources.get(SLOT_RESOURCE) == 1 for w in workers)
    hosts = [
        g for g in node_groups_of_cluster(prepared)
        if all(g.resources.get(k, 0) >= v for k, v in
               {"GPU": workers[0].num_gpus, "CPU": workers[0].num_cpus, **workers[0].resources}.items())
    ]
    assert hosts and not any(g.head for g in hosts)
    assert len(workers) <= sum(g.max_count * g.resources[SLOT_RESOURCE] for g in hosts)


# ------------------------------------------------------------------ CLI and module


def test_cli_checks_the_shipped_files_and_says_ok(capsys):
    rc = main([str(CLUSTER), str(SERVE), str(RAYSERVICE), str(ROOT / "examples" / "fleet.yaml")])
    out = capsys.readouterr().out
    assert rc == 0 and out.strip().endswith("OK")
    assert "(Ray cluster launcher config)" in out and "(KubeRay RayService)" in out


def test_cli_prints_each_error_and_fails(tmp_path, capsys, serve_raw):
    _router(serve_raw)["max_ongoing_request"] = 1024
    bad = tmp_path / "serve.yaml"
    bad.write_text(yaml.safe_dump(serve_raw))
    unknown = tmp_path / "what.yaml"
    unknown.write_text("hello: world\n")
    rc = main([str(bad), str(unknown)])
    out = capsys.readouterr().out
    assert rc == 1 and out.strip().endswith("FAILED")
    assert f"FAIL {bad}" in out and "max_ongoing_request: unknown key" in out
    assert "cannot tell what this is" in out


def test_module_imports_without_ray():
    code = "import sys, serve_app.deploy_check; sys.exit('ray' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env).returncode == 0


# ------------------------------------------------------------------ the Serve transport on every node


def _svc(docs: list) -> dict:
    return next(d for d in docs if isinstance(d, dict) and d.get("kind") == "RayService")


def test_shipped_cluster_files_run_kvroutes_serve_transport_on_every_node(cluster_raw, rayservice_docs):
    from serve_app.deploy_check import _docker_env
    from serve_app.ray_env import SERVE_ENV

    assert {k: v for k, v in _docker_env(cluster_raw["docker"]["run_options"]).items() if k in SERVE_ENV} == SERVE_ENV
    cluster = _svc(rayservice_docs)["spec"]["rayClusterConfig"]
    specs = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for s in specs:
        for c in s["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert {k: v for k, v in env.items() if k in SERVE_ENV} == SERVE_ENV, c["name"]


def test_a_node_without_the_serve_transport_is_rejected(cluster_raw, rayservice_docs):
    cfg = copy.deepcopy(cluster_raw)
    cfg["docker"]["worker_run_options"] = ["--env RAY_SERVE_PROXY_USE_GRPC=0"]
    msg = _errors(check_cluster_config, cfg)
    assert "RAY_SERVE_PROXY_USE_GRPC" in msg and "differ between nodes" in msg and "workers" in msg

    docs = copy.deepcopy(rayservice_docs)
    worker = _svc(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["env"] = [e for e in worker["env"] if not e["name"].startswith("RAY_SERVE_")]
    msg = _errors(check_rayservice, docs)
    assert "differ between nodes" in msg and "ray-worker" in msg and "none" in msg


def test_apply_serve_env_keeps_what_the_operator_set():
    from serve_app.ray_env import SERVE_ENV, apply_serve_env

    env = {"RAY_SERVE_PROXY_USE_GRPC": "0"}
    got = apply_serve_env(env)
    assert got["RAY_SERVE_PROXY_USE_GRPC"] == "0" and env["RAY_SERVE_PROXY_USE_GRPC"] == "0"
    assert all(env[k] == v for k, v in SERVE_ENV.items() if k != "RAY_SERVE_PROXY_USE_GRPC")
    assert int(SERVE_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > 8 * 1024 * 1024  # hostile-header tests


def test_a_local_ray_gets_its_own_haproxy_ports_and_a_short_drain():
    from serve_app.ray_env import LOCAL_ENV, LOCAL_PORT_ENV, apply_serve_env

    env: dict[str, str] = {}
    apply_serve_env(env)
    first = {k: env[k] for k in LOCAL_PORT_ENV}
    from actors.ports import HAPROXY_PORTS

    # outside the kernel's ephemeral range, where a port-0 bind could take a picked port first
    assert all(HAPROXY_PORTS[0] <= int(v) <= HAPROXY_PORTS[1] for v in first.values())
    assert all(env[k] == v for k, v in LOCAL_ENV.items())
    # a child that inherited kvroute's picks (a demo started from a test session) picks again
    child = dict(env)
    for _ in range(5):
        apply_serve_env(child)
        if {k: child[k] for k in LOCAL_PORT_ENV} != first:
            break
    assert {k: child[k] for k in LOCAL_PORT_ENV} != first
    # ports the operator chose stay; a cluster (local=False) gets neither picks nor the short drain
    chosen = {"RAY_SERVE_HAPROXY_STATS_PORT": "18404", "RAY_SERVE_HAPROXY_METRICS_PORT": "19101"}
    op = dict(chosen)
    apply_serve_env(op)
    assert {k: op[k] for k in LOCAL_PORT_ENV} == chosen
    cluster: dict[str, str] = {}
    apply_serve_env(cluster, local=False)
    assert not any(k in cluster for k in (*LOCAL_PORT_ENV, *LOCAL_ENV))
    assert cluster["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
