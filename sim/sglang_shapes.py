"""SGLang's `KvMetrics` classes re-created under their real module paths, to send real frames.

The simulator and the tests must emit exactly the bytes each SGLang release emits, without
installing sglang. Pickle records a class by module path and name, so we define each release's
class shape (plain class, dataclass, msgspec Struct) and register it under that release's path.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import types
from typing import Any, Callable

import msgspec

# wire form name → (module path, shape, pickle protocol | None for msgpack)
WIRE_FORMS: dict[str, tuple[str, str, int | None]] = {
    "0.4.9": ("sglang.srt.managers.scheduler", "plain", 4),
    "0.5.8": ("sglang.srt.managers.scheduler_metrics_mixin", "plain", 4),
    "0.5.10": ("sglang.srt.observability.scheduler_metrics_mixin", "plain", 4),
    "0.5.12": ("sglang.srt.observability.scheduler_metrics_mixin", "dataclass", 4),
    "0.5.14": ("sglang.srt.managers.scheduler_components.kv_events_publisher", "dataclass", 4),
    "0.5.20": ("sglang.srt.managers.scheduler_components.kv_events_publisher", "struct", 5),
    "0.5.23": ("sglang.srt.managers.scheduler_components.kv_events_publisher", "struct", 5),
    "0.5.23-msgpack": ("sglang.srt.managers.scheduler_components.kv_events_publisher", "struct", None),
}
DEFAULT_WIRE = "0.5.23"

_FIELDS = (
    ("request_active_slots", int, 0),
    ("request_total_slots", int, 0),
    ("kv_active_blocks", int, 0),
    ("kv_total_blocks", int, 0),
    ("num_requests_waiting", int, 0),
    ("gpu_cache_usage_perc", float, 0.0),
    ("gpu_prefix_cache_hit_rate", float, 0.0),
    ("data_parallel_rank", int, 0),
)

_classes: dict[tuple[str, str], type] = {}


def _module(path: str) -> types.ModuleType:
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []  # type: ignore[attr-defined]  # a package, so children import
            mod.__kvroute_shape__ = True  # type: ignore[attr-defined]
            sys.modules[name] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
    return sys.modules[path]


def _make_plain() -> type:
    class KvMetrics:  # SGLang ≤ 0.5.10: every field starts as None and is then assigned
        def __init__(self) -> None:
            for name, _, _ in _FIELDS:
                setattr(self, name, None)

    return KvMetrics


def _make_dataclass() -> type:
    return dataclasses.make_dataclass(
        "KvMetrics", [(n, t, dataclasses.field(default=d)) for n, t, d in _FIELDS]
    )


def _make_struct() -> type:
    ns = {"__annotations__": {n: t for n, t, _ in _FIELDS}, **{n: d for n, _, d in _FIELDS}}
    return types.new_class(
        "KvMetrics",
        (msgspec.Struct,),
        {"tag": True, "kw_only": True, "array_like": True},
        lambda body: body.update(ns),
    )


_MAKERS: dict[str, Callable[[], type]] = {
    "plain": _make_plain,
    "dataclass": _make_dataclass,
    "struct": _make_struct,
}


def kv_metrics_class(form: str) -> type:
    """The `KvMetrics` class of one wire form, registered under its real module path."""
    path, shape, _ = WIRE_FORMS[form]
    key = (path, shape)
    if key not in _classes:
        cls = _MAKERS[shape]()
        cls.__module__ = path
        cls.__qualname__ = "KvMetrics"
        setattr(_module(path), "KvMetrics", cls)
        _classes[key] = cls
    # several forms share a path: make sure the module currently names this form's class
    setattr(_module(path), "KvMetrics", _classes[key])
    return _classes[key]


def make_kv_metrics(form: str, **values: Any) -> Any:
    """An instance as that release's scheduler builds it (plain classes: construct, then assign)."""
    cls = kv_metrics_class(form)
    _, shape, _ = WIRE_FORMS[form]
    if shape == "plain":
        obj = cls()
        for name, value in values.items():
            setattr(obj, name, value)
        return obj
    return cls(**values)


def encode_kv_metrics(form: str, **values: Any) -> bytes:
    """The exact frame that release sends: `send_pyobj` pickle, or msgspec msgpack."""
    obj = make_kv_metrics(form, **values)
    _, _, protocol = WIRE_FORMS[form]
    if protocol is None:
        return msgspec.msgpack.encode(obj)
    return pickle.dumps(obj, protocol=protocol)


# ------------------------------------------------------------------------------ HTTP surface

# Every release the sim can claim (`--wire`), oldest first; a wire form names its release before "-".
RELEASES: tuple[str, ...] = ("0.4.9", "0.5.8", "0.5.10", "0.5.12", "0.5.14", "0.5.20", "0.5.23")
_ALL = frozenset(RELEASES)
_FROM_0_5_8 = frozenset(RELEASES[1:])

# The routes of SGLang's HTTP server (`python/sglang/srt/entrypoints/http_server.py`, its
# `v1_loads.py` router, and `/metrics`, which `add_prometheus_middleware` mounts when metrics are
# on — the sim always runs as `--enable-metrics`) that the sim serves, with their methods and the
# releases that have them. Each entry was read from that release's wheel
# (`pip download --no-deps sglang==X`): the decorators `@app.get(...)` / `@app.api_route(...)`.
#   /get_model_info, /get_server_info: every release; /model_info, /server_info added between 0.4.9
#   and 0.5.8 (both names served since). /v1/loads: from 0.5.8 (v1_loads.py). /get_load: up to and
#   including 0.5.20 (a deprecated shim over /v1/loads from 0.5.8), absent from 0.5.23.
# Anything else answers as SGLang's FastAPI app answers a route it does not have: 404
# {"detail": "Not Found"} (405 {"detail": "Method Not Allowed"} for a known path, wrong method).
# Real routes the sim does not model (LoRA from tensors, weights, sessions, /v1/models/{model}, /openapi.json, …)
# 404 too.
HTTP_ROUTES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "/health": (frozenset({"GET"}), _ALL),
    "/health_generate": (frozenset({"GET"}), _ALL),
    "/v1/models": (frozenset({"GET"}), _ALL),
    "/get_model_info": (frozenset({"GET"}), _ALL),
    "/model_info": (frozenset({"GET"}), _FROM_0_5_8),
    "/get_server_info": (frozenset({"GET"}), _ALL),
    "/server_info": (frozenset({"GET"}), _FROM_0_5_8),
    "/get_load": (frozenset({"GET"}), _ALL - {"0.5.23"}),
    "/v1/loads": (frozenset({"GET"}), _FROM_0_5_8),
    "/metrics": (frozenset({"GET"}), _ALL),
    "/flush_cache": (frozenset({"GET", "POST"}), _ALL),
    "/generate": (frozenset({"POST", "PUT"}), _ALL),
    "/v1/completions": (frozenset({"POST"}), _ALL),
    "/v1/chat/completions": (frozenset({"POST"}), _ALL),
    # dynamic LoRA (sim.lora): in every release listed (0.4.9's http_server.py has both)
    "/load_lora_adapter": (frozenset({"POST"}), _ALL),
    "/unload_lora_adapter": (frozenset({"POST"}), _ALL),
}
# The sim's own routes (not SGLang's; every release): ground truth for tests and the benchmark.
SIM_ROUTES: dict[str, frozenset[str]] = {"/sim/stats": frozenset({"GET"})}


def release_of(form: str) -> str:
    """The SGLang release a wire form claims ("0.5.23-msgpack" → "0.5.23")."""
    if form not in WIRE_FORMS:
        raise KeyError(f"unknown wire form {form!r}; expected one of {sorted(WIRE_FORMS)}")
    release = form.split("-")[0]
    assert release in RELEASES, release
    return release


def http_routes(form: str) -> dict[str, frozenset[str]]:
    """Path → methods of the SGLang routes the sim serves when it claims `form`'s release."""
    release = release_of(form)
    return {path: methods for path, (methods, releases) in HTTP_ROUTES.items() if release in releases}
