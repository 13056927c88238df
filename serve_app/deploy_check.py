"""Offline checks of kvroute's deployment files: cluster launcher YAML, Serve config, KubeRay RayService.

Each check raises `DeployCheckError` listing every problem with its place in the file, before
`ray up`, `serve deploy` or `kubectl apply` touch anything. Ray is imported inside the functions,
never at module import, so the pure helpers here load in milliseconds.
CLI: `python -m serve_app.deploy_check cluster.yaml deploy/serve_config.yaml deploy/kuberay/rayservice.yaml`.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import shlex
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from serve_app.config import DEPLOYMENT_NAME
from serve_app.ray_env import SERVE_ENV

# Custom Ray resources that steer placement (kvroute's contract with cluster configs):
HEAD_RESOURCE = "kvroute_head"  # only the head node has it; KvRouter replicas and the aggregator request it
SLOT_RESOURCE = "sglang_slot"  # one unit per SGLang engine a node can host; managed workers request 1
# What a Serve config of kvroute refers to.
KVROUTE_IMPORT_PATH = "serve_app.app:build_app"


class DeployCheckError(ValueError):
    """A deployment file is invalid; `errors` holds one line per problem, each naming where."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = list(errors)
        super().__init__(f"{source}: {len(self.errors)} problem(s):\n  " + "\n  ".join(self.errors))


@dataclass(frozen=True)
class NodeGroup:
    """Where Ray actors can go: one node type (launcher) or group (KubeRay)."""

    name: str
    resources: dict[str, float]
    max_count: int  # nodes of this kind at most (the head: 1)
    head: bool = False


# --------------------------------------------------------------------------- helpers


def _load_yaml(path: str | Path) -> list[Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise DeployCheckError(str(p), [f"cannot read: {exc.strerror}"]) from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise DeployCheckError(str(p), [f"not valid YAML: {exc}"]) from None


def _hint(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _item(path: str, index: int, item: Any) -> str:
    name = item.get("name") if isinstance(item, dict) else None
    return f"{path}[{index}]" + (f" (name {name!r})" if isinstance(name, str) else "")


def _loc(loc: Iterable[Any], raw: Any, prefix: str = "") -> str:
    """A pydantic error location as a readable path; list items are labelled with their `name`."""
    out, node = prefix, raw
    for part in loc:
        if isinstance(part, int):
            out = _item(out, part, node[part] if isinstance(node, list) and part < len(node) else None)
        else:
            out = f"{out}.{part}" if out else str(part)
        try:
            node = node[part]
        except (IndexError, KeyError, TypeError):
            node = None
    return out or "(top level)"


def _pydantic_errors(exc: Exception, raw: Any, prefix: str = "") -> list[str]:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return [f"{prefix or '(top level)'}: {exc}"]
    return [f"{_loc(e['loc'], raw, prefix)}: {e['msg']}" for e in errors()]


# --------------------------------------------------------------------------- unknown keys


def _model_fields(model: type) -> tuple[dict[str, Any], bool]:
    """({accepted key: annotation}, extras allowed) of a pydantic v2 model or v1(-compat) model."""
    fields: dict[str, Any] = {}
    if hasattr(model, "model_fields"):
        for name, f in model.model_fields.items():
            fields[name] = f.annotation
            if f.alias:
                fields[f.alias] = f.annotation
        extra = (getattr(model, "model_config", None) or {}).get("extra")
    else:  # pydantic v1 API (ray._common.pydantic_compat in older Ray)
        for name, f in getattr(model, "__fields__", {}).items():
            fields[name] = f.outer_type_
            fields[f.alias] = f.outer_type_
        extra = getattr(getattr(model, "Config", None), "extra", None)
    return fields, str(getattr(extra, "value", extra)) == "allow"


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and (hasattr(tp, "model_fields") or hasattr(tp, "__fields__"))


def _unknown_keys(raw: Any, model: type, path: str) -> list[str]:
    """Every key in `raw` that `model` (recursively) does not define. Type errors are left to pydantic."""
    if not isinstance(raw, dict):
        return []
    fields, allows_extra = _model_fields(model)
    out: list[str] = []
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            if not allows_extra:
                out.append(f"{where}: unknown key{_hint(key, fields)} -- Serve would silently ignore it")
            continue
        out += _unknown_in_value(value, fields[key], where)
    return out


def _unknown_in_value(value: Any, ann: Any, path: str) -> list[str]:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _unknown_in_value(value, args[0], path)
    if _is_model(ann):
        return _unknown_keys(value, ann, path)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, dict):
            models = [a for a in args if _is_model(a)]
            if models:  # e.g. autoscaling_config: Union[Dict, AutoscalingConfig]: hold the dict to the model
                best = max(models, key=lambda m: len(set(value) & set(_model_fields(m)[0])))
                return _unknown_keys(value, best, path)
        if isinstance(value, list):
            for a in args:
                if typing.get_origin(a) is list:
                    return _unknown_in_value(value, a, path)
        return []
    if origin is list and isinstance(value, list) and args:
        out: list[str] = []
        for i, item in enumerate(value):
            out += _unknown_in_value(item, args[0], _item(path, i, item))
        return out
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        out = []
        for k, v in value.items():
            out += _unknown_in_value(v, args[1], f"{path}.{k}")
        return out
    return []


# --------------------------------------------------------------------------- Serve config


def check_serve_config(raw: Any, source: str = "serve config") -> Any:
    """Validate a `serve deploy` config mapping and return the `ServeDeploySchema`.

    Beyond Serve's own schema: unknown keys anywhere are errors (Serve ignores them),
    `autoscaling_config` is validated (Serve keeps it as a raw dict until deploy time), and
    applications of kvroute get their `args` checked with `AppArgs` plus the router's invariants.
    Raises DeployCheckError listing every problem.
    """
    from pydantic import ValidationError

    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(raw, dict):
        raise DeployCheckError(source, ["top level must be a mapping with an 'applications' list"])
    errors: list[str] = []
    if "import_path" in raw and "applications" not in raw:
        errors.append("(top level): single-application format; put the app under applications: [- ...]")
    errors += _unknown_keys(raw, ServeDeploySchema, "")
    schema = None
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        errors += _pydantic_errors(exc, raw)
    for i, app in enumerate(raw.get("applications") or []):
        if not isinstance(app, dict):
            continue
        where = _item("applications", i, app)
        for j, dep in enumerate(app.get("deployments") or []):
            if isinstance(dep, dict) and isinstance(dep.get("autoscaling_config"), dict):
                try:
                    AutoscalingConfig.model_validate(dep["autoscaling_config"])
                except ValidationError as exc:
                    errors += _pydantic_errors(exc, dep["autoscaling_config"],
                                               f"{_item(where + '.deployments', j, dep)}.autoscaling_config")
        if app.get("import_path") == KVROUTE_IMPORT_PATH:
            errors += _kvroute_app_errors(app, where)
    if errors:
        raise DeployCheckError(source, errors)
    return schema


def _kvroute_app_errors(app: dict[str, Any], where: str) -> list[str]:
    from pydantic import ValidationError

    from serve_app.config import AppArgs

    errors: list[str] = []
    args = app.get("args") or {}
    app_args = None
    try:
        app_args = AppArgs.model_validate(args)
    except ValidationError as exc:
        errors += _pydantic_errors(exc, args, f"{where}.args")
    if app_args is not None:
        from serve_app.policies import POLICIES  # pure module: the registry of policy names

        if app_args.router.policy not in POLICIES:
            errors.append(f"{where}.args.router.policy: unknown policy {app_args.router.policy!r}"
                          f"{_hint(app_args.router.policy, POLICIES)}; valid: {', '.join(sorted(POLICIES))}")
    deployments = [d for d in app.get("deployments") or [] if isinstance(d, dict)]
    for j, dep in enumerate(deployments):
        dwhere = _item(f"{where}.deployments", j, dep)
        if dep.get("name") != DEPLOYMENT_NAME:
            errors.append(f"{dwhere}: kvroute's app has one deployment, {DEPLOYMENT_NAME!r}; "
                          "Serve refuses to deploy overrides of a deployment that does not exist")
            continue
        auto = dep.get("autoscaling_config")
        moq = dep.get("max_ongoing_requests")
        if isinstance(auto, dict):
            target = auto.get("target_ongoing_requests")
            if isinstance(moq, (int, float)) and isinstance(target, (int, float)) and moq < target:
                errors.append(f"{dwhere}: max_ongoing_requests {moq} < autoscaling_config.target_ongoing_requests "
                              f"{target}: replicas can never reach the target, so autoscaling never scales up")
            code_replicas = app_args.router.num_replicas if app_args else "auto"
            if dep.get("num_replicas") not in ("auto", None) or (
                "num_replicas" not in dep and code_replicas != "auto"
            ):
                errors.append(f"{dwhere}: with autoscaling_config set num_replicas: auto here; build_app sets "
                              f"num_replicas={code_replicas!r} from args.router.num_replicas otherwise")
        router_args = (args.get("router") or {}) if isinstance(args, dict) else {}
        if isinstance(router_args, dict) and "max_ongoing_requests" in router_args and moq is not None \
                and router_args["max_ongoing_requests"] != moq:
            errors.append(f"{dwhere}: max_ongoing_requests {moq} disagrees with args.router.max_ongoing_requests "
                          f"{router_args['max_ongoing_requests']}; set it in one place")
    return errors


# --------------------------------------------------------------------------- cluster launcher


def check_cluster_yaml(path: str | Path) -> dict[str, Any]:
    """Check a cluster launcher YAML exactly as `ray up` does before its first cloud call, then
    kvroute's placement rules. Returns the prepared config (defaults merged). Raises DeployCheckError."""
    docs = _load_yaml(path)
    if len(docs) != 1:
        raise DeployCheckError(str(path), [f"expected one YAML document, found {len(docs)}"])
    return check_cluster_config(docs[0], str(path))


def check_cluster_config(raw: Any, source: str = "cluster config") -> dict[str, Any]:
    """`check_cluster_yaml` for an already-loaded mapping.

    Replicates the offline part of `ray up` (ray.autoscaler._private.commands._bootstrap_config):
    `prepare_config` (defaults, merged setup commands, per-type min/max workers) and
    `validate_config` (ray-schema.json + head type + min_workers sum). Skipped because they call the
    cloud: the provider's `fillout_available_node_types_resources` (so every node type must declare
    `resources`, which the schema requires anyway) and `bootstrap_config` (IAM, subnets, keys).
    """
    import jsonschema

    import ray
    from ray.autoscaler._private.providers import _NODE_PROVIDERS
    from ray.autoscaler._private.util import prepare_config, validate_config

    if not isinstance(raw, dict):
        raise DeployCheckError(source, ["top level must be a mapping (cluster_name, provider, ...)"])
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    # The raw file first, for every error at once (ray up stops at the first one).
    errors = [_schema_error(e) for e in sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))]
    if errors:
        raise DeployCheckError(source, errors)
    provider = raw["provider"].get("type")
    if provider not in _NODE_PROVIDERS or _NODE_PROVIDERS[provider] is None:
        raise DeployCheckError(source, [f"provider.type: unknown provider {provider!r}; "
                                        f"known: {sorted(k for k, v in _NODE_PROVIDERS.items() if v)}"])
    try:
        prepared = prepare_config(copy.deepcopy(raw))
        validate_config(prepared)
    except jsonschema.ValidationError as exc:
        raise DeployCheckError(source, [_schema_error(exc)]) from None
    except (ValueError, RuntimeError, AssertionError, KeyError, TypeError) as exc:
        raise DeployCheckError(source, [f"ray rejects the config: {exc}"]) from None
    errors = _cluster_rules(prepared, ray.__version__)
    if errors:
        raise DeployCheckError(source, errors)
    return prepared


def _schema_error(e: Any) -> str:
    where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
    msg = e.message
    extra = re.search(r"\('([^']+)' was unexpected\)", msg)
    if e.validator == "additionalProperties" and extra:
        msg += _hint(extra.group(1), e.schema.get("properties", {}))
    return f"{where}: {msg} [ray-schema.json]"


def node_groups_of_cluster(config: dict[str, Any]) -> list[NodeGroup]:
    """The node types of a prepared cluster launcher config."""
    head = config.get("head_node_type")
    return [
        NodeGroup(name, {k: float(v) for k, v in (t.get("resources") or {}).items()},
                  1 if name == head else int(t.get("max_workers", 0)), name == head)
        for name, t in config.get("available_node_types", {}).items()
    ]


_RESOURCES_FLAG = re.compile(r"--resources(?:=|\s+)('[^']*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


def _resources_flags(commands: Iterable[str]) -> list[dict[str, float] | str]:
    found: list[dict[str, float] | str] = []
    for cmd in commands:
        for m in _RESOURCES_FLAG.finditer(cmd):
            try:
                text = shlex.split(m.group(1))[0]
                found.append(json.loads(text))
            except (ValueError, IndexError):
                found.append(m.group(1))
    return found


def _custom(resources: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")}


def _image_errors(images: dict[str, str], gpu_images: set[str], ray_version: str) -> list[str]:
    errors: list[str] = []
    pythons: dict[str, str] = {}
    for where, image in images.items():
        repo, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
        if repo == "rayproject/ray" and not (tag == ray_version or tag.startswith(ray_version + "-")):
            errors.append(f"{where}: image {image} does not match the Ray this project pins ({ray_version}); "
                          "Ray refuses nodes of another version")
        if repo == "rayproject/ray" and where in gpu_images and not re.search(r"-(gpu|cu\d+)", tag):
            errors.append(f"{where}: image {image} has no CUDA (use the -gpu tag) but the node has GPUs")
        py = re.search(r"py(\d{2,3})", tag)
        if py:
            pythons[where] = py.group(1)
    if len(set(pythons.values())) > 1:
        errors.append(f"images use different Python versions {pythons}; Ray needs one Python on all nodes")
    return errors


def _cluster_rules(config: dict[str, Any], ray_version: str) -> list[str]:
    errors: list[str] = []
    groups = node_groups_of_cluster(config)
    head = next(g for g in groups if g.head)
    workers = [g for g in groups if not g.head]
    types_ = config["available_node_types"]
    errors += _group_rules(groups, "available_node_types")
    # --resources in start commands is overridden by the node type's resources (RAY_OVERRIDE_RESOURCES)
    for key, targets in (("head_start_ray_commands", [head]), ("worker_start_ray_commands", workers)):
        for flag in _resources_flags(config.get(key) or []):
            if not isinstance(flag, dict):
                errors.append(f"{key}: --resources {flag} is not JSON")
                continue
            for g in targets:
                if _custom(flag) != _custom(g.resources):
                    errors.append(f"{key}: --resources {json.dumps(flag)} disagrees with available_node_types."
                                  f"{g.name}.resources; the launcher overrides it with the node type's resources, "
                                  "so declare them there only")
    docker = config.get("docker") or {}
    if docker:
        default = docker.get("image")
        images: dict[str, str] = {}
        gpu: set[str] = set()
        if docker.get("head_image", default):
            images[f"docker.head_image ({head.name})"] = docker.get("head_image", default)
        for g in workers:
            image = (types_[g.name].get("docker") or {}).get("worker_image") or docker.get("worker_image", default)
            if image:
                where = f"available_node_types.{g.name}.docker.worker_image" \
                    if (types_[g.name].get("docker") or {}).get("worker_image") else f"docker.worker_image ({g.name})"
                images[where] = image
                if g.resources.get("GPU", 0) > 0:
                    gpu.add(where)
        errors += _image_errors(images, gpu, ray_version)
        common = docker.get("run_options") or []
        errors += _serve_env_errors({
            "head (docker.run_options + head_run_options)": _docker_env(common + (docker.get("head_run_options") or [])),
            "workers (docker.run_options + worker_run_options)":
                _docker_env(common + (docker.get("worker_run_options") or [])),
        })
    return errors


def _docker_env(options: list[Any]) -> dict[str, str]:
    """`--env K=V` / `-e K=V` entries of docker run options."""
    out: dict[str, str] = {}
    words = [w for o in options if isinstance(o, str) for w in o.split()]
    for flag, value in zip(words, words[1:]):
        if flag in ("--env", "-e") and "=" in value:
            k, v = value.split("=", 1)
            out[k] = v
    return out


def _serve_env_errors(envs: dict[str, dict[str, str]]) -> list[str]:
    """Every Ray node/container must agree on kvroute's Serve transport (`serve_app.ray_env`): a
    proxy that calls replicas over gRPC cannot reach replicas started without it."""
    seen = {where: {k: env[k] for k in SERVE_ENV if k in env} for where, env in envs.items()}
    if len({tuple(sorted(v.items())) for v in seen.values()}) <= 1:
        return []
    detail = "; ".join(f"{where}: {v or 'none'}" for where, v in seen.items())
    return [f"the Serve transport settings ({', '.join(SERVE_ENV)}) differ between nodes — set the same "
            f"on every node (see serve_app/ray_env.py): {detail}"]


def _group_rules(groups: list[NodeGroup], where: str) -> list[str]:
    """kvroute's placement rules, the same for launcher node types and KubeRay groups."""
    errors: list[str] = []
    head = next(g for g in groups if g.head)
    if head.resources.get(HEAD_RESOURCE, 0) < 1:
        errors.append(f"{where}.{head.name}: the head must expose {HEAD_RESOURCE} (>= 1) -- KvRouter replicas "
                      "and the aggregator request it, and stay pending forever without it")
    if head.resources.get(SLOT_RESOURCE, 0) > 0:
        errors.append(f"{where}.{head.name}: the head must not expose {SLOT_RESOURCE}: engines belong on GPU nodes")
    for g in groups:
        if not g.head and g.resources.get(HEAD_RESOURCE, 0) > 0:
            errors.append(f"{where}.{g.name}: only the head may expose {HEAD_RESOURCE}; routers on a worker node "
                          "die with it when the autoscaler removes the node")
        if g.resources.get(SLOT_RESOURCE, 0) > 0 and g.resources.get("GPU", 0) <= 0:
            errors.append(f"{where}.{g.name}: exposes {SLOT_RESOURCE} but no GPU")
    if not any(g.resources.get(SLOT_RESOURCE, 0) > 0 and g.max_count > 0 for g in groups if not g.head):
        errors.append(f"{where}: no worker node type exposes {SLOT_RESOURCE} with max_workers > 0, so managed "
                      "SGLang workers can never be placed")
    return errors


# --------------------------------------------------------------------------- placement across files


def check_placement(serve: Any, groups: list[NodeGroup], aggregator_units: float = 1.0) -> list[str]:
    """Problems placing the Serve config's replicas on these node groups (empty list = fits).

    Per deployment: one replica's CPU/GPU/custom resources must fit on one node of some group, and
    at max replicas the demand for each custom resource (plus the aggregator's `aggregator_units`
    of HEAD_RESOURCE) must fit in what all nodes offering it together provide.
    """
    errors: list[str] = []
    for app in serve.applications:
        for dep in app.deployments:
            where = f"application {app.name!r} deployment {dep.name!r}"
            opts = dep.ray_actor_options.model_dump(exclude_unset=True) \
                if "ray_actor_options" in dep.model_fields_set else {}
            need = {k: float(v) for k, v in (opts.get("resources") or {}).items()}
            if opts.get("num_cpus"):
                need["CPU"] = float(opts["num_cpus"])
            if opts.get("num_gpus"):
                need["GPU"] = float(opts["num_gpus"])
            if not need:
                continue
            hosts = [g for g in groups if g.max_count > 0 and all(g.resources.get(k, 0) >= v for k, v in need.items())]
            if not hosts:
                errors.append(f"{where}: no node type offers {need} on one node; replicas would stay pending")
                continue
            auto = dep.autoscaling_config
            if isinstance(auto, dict):
                replicas = int(auto.get("max_replicas", 1))
            elif auto is not None:
                replicas = int(auto.max_replicas)
            else:
                replicas = dep.num_replicas if isinstance(dep.num_replicas, int) else 1
            for res, per in need.items():
                extra = aggregator_units if res == HEAD_RESOURCE else 0.0
                capacity = sum(g.resources.get(res, 0) * g.max_count for g in hosts)
                if per * replicas + extra > capacity:
                    errors.append(f"{where}: {replicas} replicas x {res}={per:g}"
                                  + (f" + aggregator {extra:g}" if extra else "")
                                  + f" exceed the {capacity:g} the cluster can offer; lower max_replicas or add capacity")
    return errors


# --------------------------------------------------------------------------- KubeRay


def _start_param_resources(value: Any) -> dict[str, float] | None:
    """rayStartParams.resources in KubeRay's quoting ('"{\\"x\\": 1}"') or as plain JSON."""
    parsed: Any = value
    for _ in range(2):
        if isinstance(parsed, str):
            try:
                parsed = json.loads(parsed)
            except ValueError:
                return None
    return parsed if isinstance(parsed, dict) else None


def _quantity(value: Any) -> float:
    """A Kubernetes quantity for CPU/GPU counts ("8", 8, "500m")."""
    s = str(value)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def _group_of(spec: dict[str, Any], name: str, head: bool, where: str, errors: list[str]) -> NodeGroup:
    params = spec.get("rayStartParams") or {}
    for k, v in params.items():
        if not isinstance(v, str):
            errors.append(f"{where}.rayStartParams.{k}: must be a string (the CRD is map[string]string); "
                          f"quote it: '{v}'")
    resources: dict[str, float] = {}
    if "resources" in params:
        parsed = _start_param_resources(params["resources"])
        if parsed is None:
            errors.append(f"{where}.rayStartParams.resources: not JSON; write it as "
                          "'\"{\\\"name\\\": 1}\"' (KubeRay's quoting)")
        else:
            resources.update({k: float(v) for k, v in parsed.items()})
    containers = (((spec.get("template") or {}).get("spec") or {}).get("containers")) or []
    limits = ((containers[0].get("resources") or {}).get("limits") or {}) if containers else {}
    cpu = params.get("num-cpus", limits.get("cpu"))
    gpu = params.get("num-gpus", limits.get("nvidia.com/gpu"))
    try:
        if cpu is not None:
            resources["CPU"] = _quantity(cpu)
        if gpu is not None:
            resources["GPU"] = _quantity(gpu)
    except ValueError:
        errors.append(f"{where}: cannot read CPU/GPU counts {cpu!r}/{gpu!r}")
    count = 1 if head else int(spec.get("maxReplicas", spec.get("replicas", 0)) or 0)
    return NodeGroup(name, resources, count, head)


def check_rayservice(docs: Any, source: str = "rayservice") -> dict[str, Any]:
    """Validate a KubeRay RayService manifest (one document or a list of them, e.g. with ConfigMaps):
    the cluster's groups against kvroute's placement rules, `serveConfigV2` with
    `check_serve_config` and `check_placement`, and fleet files carried in ConfigMaps.
    Returns the RayService document. Raises DeployCheckError."""
    import ray

    from actors.fleet import FleetError
    from serve_app.config import fleet_for_app

    docs = docs if isinstance(docs, list) else [docs]
    services = [d for d in docs if isinstance(d, dict) and d.get("kind") == "RayService"]
    if len(services) != 1:
        raise DeployCheckError(source, [f"expected one document of kind RayService, found {len(services)}"])
    svc = services[0]
    errors: list[str] = []
    if svc.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion: {svc.get('apiVersion')!r}, expected 'ray.io/v1'")
    spec = svc.get("spec") or {}
    cluster = spec.get("rayClusterConfig") or {}
    if cluster.get("rayVersion") != ray.__version__:
        errors.append(f"spec.rayClusterConfig.rayVersion: {cluster.get('rayVersion')!r}, expected "
                      f"{ray.__version__!r} (the Ray this project pins)")
    groups: list[NodeGroup] = []
    images: dict[str, str] = {}
    gpu_images: set[str] = set()
    head_spec = cluster.get("headGroupSpec")
    if not isinstance(head_spec, dict):
        errors.append("spec.rayClusterConfig.headGroupSpec: missing")
    else:
        groups.append(_group_of(head_spec, "headGroupSpec", True, "spec.rayClusterConfig.headGroupSpec", errors))
    for i, w in enumerate(cluster.get("workerGroupSpecs") or []):
        where = _item("spec.rayClusterConfig.workerGroupSpecs", i, {"name": w.get("groupName")})
        groups.append(_group_of(w, w.get("groupName", f"group{i}"), False, where, errors))
    for g, s in zip(groups, [head_spec] + list(cluster.get("workerGroupSpecs") or [])):
        for c in (((s or {}).get("template") or {}).get("spec") or {}).get("containers") or []:
            if c.get("image"):
                where = f"{g.name} container {c.get('name')!r}"
                images[where] = c["image"]
                if g.resources.get("GPU", 0) > 0:
                    gpu_images.add(where)
    if groups and groups[0].head:
        errors += _group_rules(groups, "spec.rayClusterConfig")
    envs: dict[str, dict[str, str]] = {}
    for g, s in zip(groups, [head_spec] + list(cluster.get("workerGroupSpecs") or [])):
        for c in (((s or {}).get("template") or {}).get("spec") or {}).get("containers") or []:
            envs[f"{g.name} container {c.get('name')!r}"] = {
                e["name"]: str(e.get("value", "")) for e in c.get("env") or [] if isinstance(e, dict) and "name" in e}
    errors += _serve_env_errors(envs)
    errors += _image_errors(images, gpu_images, ray.__version__)
    text = spec.get("serveConfigV2")
    if not isinstance(text, str):
        errors.append("spec.serveConfigV2: missing or not a string (write it as a YAML block: `serveConfigV2: |`)")
    else:
        try:
            serve = check_serve_config(yaml.safe_load(text), f"{source}: spec.serveConfigV2")
            if groups and groups[0].head:
                errors += [f"spec.serveConfigV2: {e}" for e in check_placement(serve, groups)]
        except DeployCheckError as exc:
            errors += [f"spec.serveConfigV2: {e}" for e in exc.errors]
        except yaml.YAMLError as exc:
            errors.append(f"spec.serveConfigV2: not valid YAML: {exc}")
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "ConfigMap":
            for key, value in (d.get("data") or {}).items():
                content = yaml.safe_load(value) if isinstance(value, str) and key.endswith((".yaml", ".yml")) else None
                if isinstance(content, dict) and "workers" in content:
                    where = f"ConfigMap {d.get('metadata', {}).get('name')!r} data.{key}"
                    try:  # the Serve app reads it: workers and settings (the router is in args.router)
                        fleet_for_app(content, where)
                    except FleetError as exc:
                        errors.append(str(exc))
    if errors:
        raise DeployCheckError(source, errors)
    return svc


# --------------------------------------------------------------------------- CLI


def detect_kind(docs: list[Any]) -> str:
    """'rayservice' | 'cluster' | 'serve' | 'fleet' | 'unknown', from a file's YAML documents."""
    if any(isinstance(d, dict) and d.get("kind") == "RayService" for d in docs):
        return "rayservice"
    if len(docs) == 1 and isinstance(docs[0], dict):
        d = docs[0]
        if "provider" in d and ("available_node_types" in d or "cluster_name" in d):
            return "cluster"
        if "applications" in d or "import_path" in d:
            return "serve"
        if "workers" in d:
            return "fleet"
    return "unknown"


_KIND_LABEL = {"cluster": "Ray cluster launcher config", "serve": "Serve config",
               "rayservice": "KubeRay RayService", "fleet": "kvroute fleet file"}


def check_file(path: str | Path) -> tuple[str, Any]:
    """Detect a file's kind by content and check it. Returns (kind, checked object)."""
    from actors.fleet import FleetError
    from serve_app.config import parse_config

    docs = _load_yaml(path)
    kind = detect_kind(docs)
    if kind == "cluster":
        return kind, check_cluster_config(docs[0], str(path))
    if kind == "serve":
        return kind, check_serve_config(docs[0], str(path))
    if kind == "rayservice":
        return kind, check_rayservice(docs, str(path))
    if kind == "fleet":
        try:
            return kind, parse_config(docs[0], str(path))  # the whole tree: workers, settings, router
        except FleetError as exc:
            raise DeployCheckError(str(path), [str(exc)]) from None
    raise DeployCheckError(str(path), ["cannot tell what this is: expected a cluster launcher config "
                                       "(provider:), a Serve config (applications:), a RayService "
                                       "(kind: RayService) or a fleet file (workers:)"])


def main(argv: list[str] | None = None) -> int:
    """Check each file; with a cluster config and a Serve config together, check placement too."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths or paths[0] in ("-h", "--help"):
        print("usage: python -m serve_app.deploy_check FILE... "
              "(cluster.yaml, deploy/serve_config.yaml, deploy/kuberay/rayservice.yaml, fleet files)")
        return 0 if paths else 2
    failed = False
    checked: dict[str, list[Any]] = {}
    for p in paths:
        try:
            kind, obj = check_file(p)
        except DeployCheckError as exc:
            failed = True
            print(f"FAIL {p}")
            for line in exc.errors:
                print(f"  {line}")
            continue
        checked.setdefault(kind, []).append(obj)
        print(f"ok   {p} ({_KIND_LABEL[kind]})")
    for cluster in checked.get("cluster", []):
        for serve in checked.get("serve", []):
            problems = check_placement(serve, node_groups_of_cluster(cluster))
            if problems:
                failed = True
                print("FAIL placement of the Serve config on the cluster config")
                for line in problems:
                    print(f"  {line}")
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
