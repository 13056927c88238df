"""The fleet file: which SGLang workers exist, where they listen, and (managed mode) how to launch them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.wire.kv_handshake import HandshakeError, plan_subscription
from actors.models import Settings

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_ENDPOINT = re.compile(r"^(ipc://.+|tcp://([^:/\[\]]+|\[[0-9A-Fa-f:.]+\]):\d{1,5})$")


def _is_wildcard(host: str) -> bool:
    """Every spelling ZMQ would bind on all interfaces: '*', '0.0.0.0', '0', '0x0', '::', '[::]' …"""
    import ipaddress
    import socket

    h = host.strip("[]")
    if h in ("*", ""):
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        pass
    try:  # inet_aton accepts the short and hex forms ('0', '0.0', '0x0', '000.000.000.000')
        return socket.inet_aton(h) == b"\0\0\0\0"
    except OSError:
        return False


class FleetError(ValueError):
    """A fleet file is unreadable or invalid; the message names the entry and field."""


class WorkerSpec(BaseModel):
    """One SGLang worker. Attach mode: `url` + `metrics_endpoint`. Managed mode: `engine` set."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="unique worker name (1-63 letters, digits, '_', '.', '-')")
    url: str | None = Field(None, description="HTTP base URL (managed mode: chosen if omitted)")
    metrics_endpoint: str | None = Field(
        None, description="ZMQ endpoint the worker actor BINDS a PULL on (SGLang connects)"
    )
    page_size: int = Field(
        1, ge=1, le=4096, description="the server's --page-size: converts SGLang's token counts to pages"
    )
    # managed mode
    engine: Literal["sim", "sglang"] | None = Field(
        None, description="managed mode: the worker actor launches this engine (unset = attach mode)"
    )
    model: str | None = Field(None, description="model path or name (required with engine: sglang); the model "
                              "the worker serves unless served_model_names says otherwise")
    served_model_names: list[str] = Field(
        default_factory=list, max_length=64,
        description="the model name(s) requests may name to reach this worker (aliases allowed); unset: managed "
        "mode's model (or engine_args.served_model_name), attach mode asks the worker's GET /v1/models",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="extra server flags, snake_case (tp_size → --tp-size); kvroute sets --host, --port, "
        "--page-size, --enable-metrics, --kv-events-config and (engine: sglang, unless given here) "
        "--enable-cache-report itself",
    )
    env: dict[str, str] = Field(
        default_factory=dict, max_length=256,
        description="managed mode: environment variables added to the engine's own (e.g. SGLANG_USE_CPU_ENGINE, "
        "OMP_NUM_THREADS, HF_HOME); kvroute's own KVROUTE_* variables and CUDA_VISIBLE_DEVICES (Ray sets it from "
        "num_gpus) cannot be set here",
    )
    python: str | None = Field(
        None, description="managed mode, engine: sglang: the Python interpreter of the environment SGLang is "
        "installed in (its own torch and kernels), e.g. /opt/sglang/bin/python; default: kvroute's own. kvroute "
        "runs `PYTHON -m actors.sglang_launch` with kvroute's source directory on its PYTHONPATH (nothing of "
        "kvroute's needs to be installed there)",
    )
    kv_events_endpoint: str | None = Field(
        None, description="the endpoint of SGLang's --kv-events-config, as given there (auto: managed mode picks "
        "a loopback/node port that the worker actor binds); who binds follows SGLang's own rule (actors.wire.kv_handshake)",
    )
    kv_events_bind: bool | None = Field(
        None, description="SGLang's \"bind\" key of --kv-events-config (honoured by SGLang >= 0.5.22 only)"
    )
    kv_events_replay_endpoint: str | None = Field(
        None, description="SGLang's replay_endpoint (a ROUTER SGLang binds); kvroute asks it for lost batches"
    )
    dp_size: int = Field(
        1, ge=1, le=1024, description="attention-DP ranks of the engine (SGLang --dp-size with "
        "--enable-dp-attention): each rank is a routing target, and the forwarded request pins the chosen one "
        "(`data_parallel_rank`); with role prefill/decode both ranks of the pair are pinned (docs/pd.md); "
        "managed mode passes --dp-size to the engine",
    )
    replicas: int = Field(1, ge=1, le=1024, description="expand into name-0 … name-(n-1)")
    num_gpus: float = Field(0, ge=0, description="GPUs the worker actor requests (= the engine's tp_size)")
    num_cpus: float = Field(0, ge=0, description="CPUs the worker actor requests")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources the worker actor requests (e.g. sglang_slot)"
    )
    node_id: str | None = Field(None, description="pin the worker's actor to this Ray node")
    host: str = Field(
        "auto", description="managed engines listen here; auto = 127.0.0.1 on a one-node Ray, else the node's IP"
    )
    role: Literal["prefill", "decode", "both"] = Field(
        "both", description="prefill/decode disaggregation (docs/pd.md): `prefill` or `decode` for a server run "
        "with SGLang's --disaggregation-mode of that name, `both` (default) for an ordinary server. A model "
        "whose workers include prefill/decode ones is served by a prefill + decode pair per request",
    )
    bootstrap_port: int | None = Field(
        None, ge=1, le=65535, description="role: prefill only, and required there: the server's "
        "--disaggregation-bootstrap-port (SGLang's default is 8998); the decode side fetches the KV from it. "
        "Managed mode passes it (and --disaggregation-mode) to the engine; replicas get bootstrap_port + i",
    )

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be 1-63 chars of letters, digits, '_', '.', '-'")
        return v

    @field_validator("served_model_names")
    @classmethod
    def _model_names_ok(cls, v: list[str]) -> list[str]:
        for n in v:
            if not n or len(n) > 256 or n != n.strip():
                raise ValueError(f"{n!r}: a model name is 1-256 characters without surrounding spaces")
        if len(set(v)) != len(v):
            raise ValueError("a model name is listed twice")
        return v

    @field_validator("env")
    @classmethod
    def _env_ok(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", key):
                raise ValueError(f"{key!r}: an environment variable name is letters, digits and '_'")
            if key.startswith("KVROUTE_") or key == "CUDA_VISIBLE_DEVICES":
                raise ValueError(f"{key}: set by kvroute (or by Ray from num_gpus), not by the fleet file")
        return v

    @field_validator("python")
    @classmethod
    def _python_ok(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "\0" in v):
            raise ValueError("must be the path of a Python interpreter")
        return v

    @field_validator("url")
    @classmethod
    def _url_ok(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+(:\d+)?/?$", v):
            raise ValueError("must be an http(s) base URL such as http://127.0.0.1:30001")
        return v.rstrip("/") if v else v

    @field_validator("metrics_endpoint", "kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _endpoint_ok(cls, v: str | None, info: Any) -> str | None:
        if v == "auto" and info.field_name == "kv_events_endpoint":
            return v  # managed mode: a free loopback/node port chosen at launch
        if v is not None and not _ENDPOINT.match(v):
            raise ValueError("must be ipc://PATH or tcp://HOST:PORT")
        if (info.field_name == "metrics_endpoint" and v is not None and v.startswith("tcp://")
                and _is_wildcard(v[len("tcp://"):].rsplit(":", 1)[0])):
            raise ValueError("bind a specific address, not a wildcard (metrics frames are trusted input)")
        return v

    @model_validator(mode="after")
    def _mode_complete(self) -> "WorkerSpec":
        if self.engine is None:
            missing = [f for f in ("url", "metrics_endpoint") if getattr(self, f) is None]
            if missing:
                raise ValueError(
                    f"attach mode needs {' and '.join(missing)} (or set engine: sim|sglang to launch it)"
                )
            if self.replicas != 1:
                raise ValueError("replicas needs managed mode (engine: sim|sglang)")
        if self.kv_events_endpoint == "auto" and self.engine is None:
            raise ValueError("kv_events_endpoint: auto needs managed mode (engine: sim|sglang)")
        given = self.engine_args.get("dp_size")
        if given is not None and given != self.dp_size:
            raise ValueError(f"engine_args.dp_size={given!r}: set the entry's dp_size instead (it is {self.dp_size}; "
                             "the router must know the ranks to route to them)")
        if self.engine == "sglang" and not self.model:
            raise ValueError("engine: sglang needs model (a model path or name)")
        if self.engine is None and (self.env or self.python):
            raise ValueError("env and python are for managed mode (engine: sim|sglang): kvroute starts no process "
                             "in attach mode")
        if self.python and self.engine != "sglang":
            raise ValueError("python is for engine: sglang (the simulator runs in kvroute's own Python)")
        if self.role == "prefill" and self.bootstrap_port is None:
            raise ValueError(f"worker {self.name!r}: role: prefill needs bootstrap_port (the server's "
                             f"--disaggregation-bootstrap-port, SGLang's default 8998)")
        if self.role != "prefill" and self.bootstrap_port is not None:
            raise ValueError(f"worker {self.name!r}: bootstrap_port is for role: prefill only (role is {self.role})")
        if self.role != "both" and self.dp_size > 1 and self.engine == "sim":
            wire = str(self.engine_args.get("wire", "0.5.23"))
            if tuple(int(x) for x in wire.split("-")[0].split(".")[:3]) < (0, 5, 14):
                raise ValueError(f"worker {self.name!r}: dp_size > 1 with role: {self.role} needs an SGLang release "
                                 f"that reads routed_dp_rank and disagg_prefill_dp_rank (0.5.14 or later); "
                                 f"engine_args.wire is {wire}")
        if self.kv_events_endpoint not in (None, "auto"):
            try:  # who binds is decided here, exactly as SGLang decides it; refused forms say why
                plan_subscription(self.kv_events_endpoint, bind=self.kv_events_bind,
                                  replay_endpoint=self.kv_events_replay_endpoint, ranks=self.kv_event_ranks)
            except HandshakeError as exc:
                raise ValueError(f"kv_events_endpoint: {exc}") from None
        elif self.kv_events_bind is not None or self.kv_events_replay_endpoint is not None:
            if self.kv_events_endpoint is None:
                raise ValueError("kv_events_bind / kv_events_replay_endpoint need kv_events_endpoint")
        return self

    @property
    def kv_event_ranks(self) -> int:
        """KV-event publishers of this engine: one per DP rank, on port base + rank (SGLang 0.5.23 counts
        attention-DP ranks, or DP replicas without DP-attention; older releases only attention-DP ranks)."""
        return self.dp_size

    @property
    def declared_models(self) -> list[str]:
        """The model names this entry says the worker serves ([] = ask the worker's /v1/models)."""
        if self.served_model_names:
            return list(self.served_model_names)
        served = self.engine_args.get("served_model_name")
        if self.managed and (served or self.model):
            return [str(served or self.model)]
        return []

    @property
    def managed(self) -> bool:
        return self.engine is not None


class FleetSpec(BaseModel):
    """The whole fleet file."""

    model_config = ConfigDict(extra="forbid")

    workers: list[WorkerSpec] = Field(min_length=1, description="the SGLang workers (at least one)")
    settings: Settings = Field(default_factory=Settings, description="the metrics plane's thresholds")

    @model_validator(mode="after")
    def _unique(self) -> "FleetSpec":
        seen: dict[str, int] = {}
        for i, w in enumerate(self.expanded()):
            if w.name in seen:
                raise ValueError(f"workers: name {w.name!r} is used twice")
            seen[w.name] = i
        endpoints = [w.metrics_endpoint for w in self.workers if w.metrics_endpoint]
        dup = {e for e in endpoints if endpoints.count(e) > 1}
        if dup:
            raise ValueError(f"workers: metrics_endpoint {sorted(dup)[0]} is used twice")
        return self

    def expanded(self) -> list[WorkerSpec]:
        """Workers with `replicas: n` turned into n entries named `name-0` … `name-(n-1)`."""
        out: list[WorkerSpec] = []
        for w in self.workers:
            if w.replicas == 1:
                out.append(w)
                continue
            for i in range(w.replicas):  # a prefill replica's bootstrap server needs a port of its own
                port = {"bootstrap_port": w.bootstrap_port + i} if w.bootstrap_port is not None else {}
                out.append(w.model_copy(update={"name": f"{w.name}-{i}", "replicas": 1, **port}))
        return out


def _fields_of(tp: Any) -> list[str] | None:
    """The keys a model (or dataclass) accepts, or None when `tp` is neither."""
    import dataclasses

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    if dataclasses.is_dataclass(tp):
        return [f.name for f in dataclasses.fields(tp)]
    return None


def _model_at(model: type, loc: list[Any]) -> type | None:
    """The model/dataclass type found by following `loc` (field names; list indices skipped)."""
    import typing

    tp: Any = model
    for p in loc:
        if isinstance(p, int):
            continue
        fields = getattr(tp, "model_fields", None)
        if fields is not None and p in fields:
            tp = fields[p].annotation
        elif _fields_of(tp) is not None and p in (hints := typing.get_type_hints(tp)):
            tp = hints[p]
        else:
            return None
        tp = model_in(tp)
    return tp if _fields_of(tp) is not None else None


def model_in(tp: Any) -> Any:
    """The model inside `Optional[X]`, `list[X]`, `X | str` … (the first one found), else `tp`."""
    import typing

    if _fields_of(tp) is not None:
        return tp
    for arg in typing.get_args(tp):
        found = model_in(arg)
        if _fields_of(found) is not None:
            return found
    return tp


def _describe(err: dict[str, Any], raw: Any, model: type | None = None) -> str:
    loc = list(err["loc"])
    parts: list[str] = []
    node = raw
    for i, p in enumerate(loc):
        if isinstance(p, int) and parts:
            name = None
            try:
                name = node[p].get("name") if isinstance(node[p], dict) else None
            except (IndexError, KeyError, TypeError):
                pass
            parts[-1] += f"[{p}]" + (f" (name {name!r})" if name else "")
        else:
            parts.append(str(p))
        try:
            node = node[p]
        except (IndexError, KeyError, TypeError):
            node = None
    where = ".".join(parts) or "file"
    msg = err["msg"]
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument") and model is not None:
        # an unknown key: say so, with the keys valid at that place (a typo's fix is usually there)
        import difflib

        known = _fields_of(_model_at(model, loc[:-1]))
        if known:
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            msg = (f"unknown key{f' (did you mean {close[0]!r}?)' if close else ''}; "
                   f"valid here: {', '.join(known)}")
    return f"{where}: {msg}"


def parse_fleet(raw: Any, source: str = "fleet", model: type[FleetSpec] = FleetSpec) -> FleetSpec:
    """Validate an already-loaded fleet mapping as `model` (FleetSpec, or a subclass that adds
    sections, e.g. serve_app.config.KvrouteConfig). Raises FleetError naming entry and field."""
    if not isinstance(raw, dict):
        raise FleetError(f"{source}: top level must be a mapping with a 'workers' list")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        lines = [_describe(e, raw, model) for e in exc.errors()]
        raise FleetError(f"{source}: invalid fleet file:\n  " + "\n  ".join(lines)) from None


def read_fleet_file(path: str | Path) -> Any:
    """The YAML content of a fleet file, unvalidated. Raises FleetError if unreadable or not YAML."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise FleetError(f"{p}: cannot read fleet file: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetError(f"{p}: not valid YAML: {exc}") from None


def load_fleet(path: str | Path, model: type[FleetSpec] = FleetSpec) -> FleetSpec:
    """Read and validate a fleet YAML file as `model`. Raises FleetError with file, entry and field."""
    return parse_fleet(read_fleet_file(path), str(path), model)
