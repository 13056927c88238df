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
