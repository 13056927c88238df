"""Frames from an SGLang scheduler's metrics socket → validated `KvMetrics`, executing nothing.

SGLang sends `KvMetrics` either pickled (every release; from 0.5.16 via `sock_send`, still pickle by
default) or, with `SGLANG_USE_PICKLE_IPC=0`, as a msgspec msgpack tagged array. The pickled class
lives under a different module path per release and is a plain class, a dataclass or a
`msgspec.Struct`. We accept exactly those shapes and nothing else: pickles are read by an
allow-list unpickler whose globals resolve to inert stand-ins, so no frame can call anything.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import msgspec
from pydantic import ValidationError

from actors.models import KV_METRICS_FIELDS, KvMetrics

DEFAULT_MAX_FRAME_BYTES = 64 * 1024

# Where each SGLang release defines KvMetrics (the pickle carries this path).
KV_METRICS_MODULES: tuple[str, ...] = (
    "sglang.srt.managers.scheduler",  # 0.4.9
    "sglang.srt.managers.scheduler_metrics_mixin",  # 0.4.10 – 0.5.8
    "sglang.srt.observability.scheduler_metrics_mixin",  # 0.5.10 – 0.5.12
    "sglang.srt.managers.scheduler_components.kv_events_publisher",  # 0.5.14 – 0.5.23
)
_MSGSPEC_REBUILD = ("msgspec._utils", "rebuild")

_PICKLE_PROTO = 0x80  # protocol ≥ 2 pickles start with PROTO; SGLang sends 4 or 5
_MSGPACK_ARRAY_9 = 0x99  # fixarray of 9 elements: ["KvMetrics", 8 fields]


class WireError(ValueError):
    """A frame was refused. `reason` is a short machine-readable tag for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _KvMetricsStandIn:
    """What an allow-listed `KvMetrics` global resolves to: a bare attribute holder. It has no
    `__setstate__`, so pickle's BUILD fills `__dict__` in C and no code of the sender's runs."""


def _state_fields(state: Any) -> dict[str, Any]:
    # plain class / dataclass: a dict; slotted dataclass: (dict | None, dict | None)
    if isinstance(state, dict):
        return state
    if isinstance(state, tuple) and len(state) == 2 and all(p is None or isinstance(p, dict) for p in state):
        return {**(state[0] or {}), **(state[1] or {})}
    raise WireError("bad_pickle", "object state is not a mapping")


def _rebuild_struct(cls: Any, state: Any) -> _KvMetricsStandIn:
    """Stand-in for `msgspec._utils.rebuild(cls, state)` (how pickled Structs are rebuilt)."""
    if cls is not _KvMetricsStandIn:
        raise WireError("forbidden_global", "msgspec rebuild of a class other than KvMetrics")
    obj = _KvMetricsStandIn()
    obj.__dict__.update(_state_fields(state))
    return obj


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only SGLang's KvMetrics and msgspec's rebuild helper, both to inert stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "KvMetrics" and module in KV_METRICS_MODULES:
            return _KvMetricsStandIn
        if (module, name) == _MSGSPEC_REBUILD:
            return _rebuild_struct
        raise WireError("forbidden_global", f"pickle refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise WireError("forbidden_global", "pickle uses persistent ids")


_msgpack_decoder = msgspec.msgpack.Decoder()
_N_FIELDS = len(KV_METRICS_FIELDS)
_FIELD_KEYS = frozenset(KV_METRICS_FIELDS)
_validator = KvMetrics.__pydantic_validator__


# Opcodes a KvMetrics pickle (protocol 2-5) can contain → how many argument bytes follow:
# n ≥ 0 fixed, -1/-4/-8 a little-endian length prefix of that many bytes (1, 4, 8).
_ARG_BYTES: dict[int, int] = {
    **dict.fromkeys(b"N\x88\x89]ael)t\x85\x86\x87}dsu012(\x94\x93Rb\x81.", 0),
    ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8, ord("h"): 1, ord("j"): 4, ord("q"): 1,
    0x80: 1, 0x95: 8,  # PROTO, FRAME
    0x8C: -1, ord("U"): -1, 0x8A: -1,  # SHORT_BINUNICODE, SHORT_BINSTRING, LONG1
    ord("X"): -4, 0x8B: -4,  # BINUNICODE, LONG4
}
_GLOBAL_OPCODES = frozenset(b"cio\x92")  # GLOBAL, INST, OBJ, NEWOBJ_EX: protocol-0/2 ways to name code


def _check_opcodes(frame: bytes) -> None:
    """Walk the opcodes before the C unpickler sees them. Refuses any opcode SGLang's KvMetrics
    pickles never use — notably LONG_BINPUT, whose index makes the C unpickler allocate and zero a
    memo of that size (a 9-byte frame could cost GiBs), extension codes and persistent ids."""
    i, n = 0, len(frame)
    get = _ARG_BYTES.get
    try:
        while True:
            op = frame[i]
            arg = get(op)
            if arg is None:
                if op in _GLOBAL_OPCODES:
                    raise WireError("forbidden_global", f"opcode {chr(op)!r} names a global outside the allow-list")
                raise WireError("bad_pickle", f"opcode 0x{op:02x} at byte {i} is not used by SGLang's KvMetrics")
            if arg == 0:
                if op == 0x2E:  # STOP
                    return
                i += 1
            elif arg > 0:
                i += 1 + arg
            elif arg == -1:
                i += 2 + frame[i + 1]
            else:
                i += 5 + int.from_bytes(frame[i + 1:i + 5], "little")
    except IndexError:
        pass
    raise WireError("bad_pickle", "truncated pickle")


def _fields_from_pickle(frame: bytes) -> dict[str, Any]:
    _check_opcodes(frame)
    try:
        obj = _AllowListUnpickler(io.BytesIO(frame)).load()
    except WireError:
        raise
    except RecursionError as exc:
        raise WireError("bad_pickle", "nesting too deep") from exc
    except Exception as exc:  # any malformed pickle: truncated, bad opcode, wrong arity …
        raise WireError("bad_pickle", f"{type(exc).__name__}: {exc}"[:200]) from exc
    if type(obj) is not _KvMetricsStandIn:
        raise WireError("not_kv_metrics", f"pickle holds {type(obj).__name__}, not KvMetrics")
    return obj.__dict__


def _fields_from_msgpack(frame: bytes) -> dict[str, Any]:
    try:
        arr = _msgpack_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError("bad_msgpack", str(exc)[:200]) from exc
    # the tagged positional array of msgspec's Struct(tag=True, array_like=True)
    if type(arr) is not list or not arr or arr[0] != "KvMetrics":
        raise WireError("bad_msgpack", "not a ['KvMetrics', ...] tagged array")
    if len(arr) != _N_FIELDS + 1:
        raise WireError("bad_msgpack", f"KvMetrics array has {len(arr) - 1} fields, expected {_N_FIELDS}")
    return dict(zip(KV_METRICS_FIELDS, arr[1:]))


def decode_kv_metrics(frame: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> KvMetrics:
    """Decode one frame as any SGLang release 0.4.9 … 0.5.23 sends it.

    Raises `WireError` (a `ValueError`, with `.reason`) for oversized, malformed, foreign or
    out-of-range frames. Never calls code named by the frame.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError("bad_type", f"frame is {type(frame).__name__}, not bytes")
    size = len(frame)
    if size > max_bytes:
        raise WireError("oversized", f"{size} bytes > limit {max_bytes}")
    if size == 0:
        raise WireError("empty", "zero-length frame")
    first = frame[0]
    if first == _PICKLE_PROTO:
        fields = _fields_from_pickle(bytes(frame))
    elif first == _MSGPACK_ARRAY_9 or first in (0xDC, 0xDD) or 0x90 <= first <= 0x9F:
        fields = _fields_from_msgpack(bytes(frame))
    else:
        raise WireError("unknown_format", f"first byte 0x{first:02x} is neither pickle nor msgpack")
    return _validate(fields)


def _validate(fields: dict[str, Any]) -> KvMetrics:
    if fields.keys() == _FIELD_KEYS and fields["data_parallel_rank"] is not None:  # the common case
        try:
            return _validator.validate_python(fields)
        except ValidationError as exc:
            raise _invalid(exc) from None
    # Old plain classes start every field as None; SGLang's 0.4.9 sender always fills all eight,
    # but data_parallel_rank None means "no DP" wherever it appears.
    if fields.get("data_parallel_rank", 0) is None:
        fields = {**fields, "data_parallel_rank": 0}
    unknown = set(fields) - set(KV_METRICS_FIELDS)
    if unknown:
        raise WireError("unknown_field", f"unexpected fields {sorted(map(repr, unknown))[:5]}")
    try:
        return _validator.validate_python(fields)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> WireError:
    err = exc.errors(include_url=False, include_context=False, include_input=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "frame"
    return WireError("invalid_value", f"{where}: {err['msg']} (got {_describe(_input_at(exc))})")


def _input_at(exc: ValidationError) -> Any:
    # the offending value without letting pydantic render it (repr of a hostile value can explode)
    try:
        return exc.errors(include_url=False, include_context=False)[0].get("input")
    except Exception:
        return None


def _describe(value: Any) -> str:
    """A bounded description of a refused value: never the repr of a container."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if -10**18 < value < 10**18 else f"an int of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40])
    return f"a {type(value).__name__}"
