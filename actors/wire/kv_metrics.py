"""Frames from an SGLang scheduler's metrics socket → validated `KvMetrics`, executing nothing.

SGLang sends `KvMetrics` either pickled (every release; from 0.5.16 via `sock_send`, still pickle by
default) or, with `SGLANG_USE_PICKLE_IPC=0`, as a msgspec msgpack tagged array. The pickled class
lives under a different module path per release and is a plain class, a dataclass or a
`msgspec.Struct`. We accept exactly those shapes and nothing else: pickles are read by an
allow-list unpickler whose globals resolve to inert stand-ins, so no frame can call anything.

The receive path is hot (one call per frame), so the exact frames SGLang writes take a fast path
that runs neither the unpickler nor a Python opcode walk (see "fast path" below); every other frame
goes through the safe path, which decides acceptance and refusal reasons exactly as before.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from typing import Annotated, Any, NamedTuple

import msgspec
from pydantic import ValidationError

from actors.models import INT64_MAX, KV_METRICS_FIELDS, KvMetrics

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
    i = 0
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


# --- fast path: the exact pickles SGLang's schedulers write, matched without unpickling -------------
#
# `pickle.dumps` of SGLang's KvMetrics (plain class, dataclass, or msgspec Struct; protocol 4 or 5,
# what `send_pyobj`/`sock_send` use) is a fixed skeleton — PROTO, FRAME, the class global(s), MARK,
# then eight `name, value` pairs in field order, SETITEMS, BUILD | REDUCE, STOP — with eight holes
# for the value tokens. We generate those skeletons at import from the module paths and field names
# (with pickle's own opcode constants), pick one by the first bytes after the header (a dict lookup),
# match the holes with a compiled regex that skips the fixed spans in O(1) and captures them, and
# compare the captured spans with the skeleton (memcmp). A frame that matches is, byte for byte, one
# the safe path accepts with the same values, so it needs neither the opcode walk nor the
# unpickler; the regex only admits in-range values (ints 0 … 2**63-1, floats in [0, 1] or -0.0,
# rank None), so the values need no further check. Anything else — another memo layout, field
# order, a bool, a negative or huge int, NaN, an extra opcode, trailing bytes — falls through to the
# safe path, which accepts or refuses it exactly as before (same reason, same message). Protocol 2/3
# pickles name the class with GLOBAL, which the safe path's opcode walk refuses: they get no fast
# path, so they stay refused.


class _Skeleton(NamedTuple):
    protocols: frozenset[int]
    window: bytes  # the bytes right after PROTO [FRAME] that select this skeleton
    fixed: tuple[bytes, ...]  # the fixed spans after the window: 9 spans around 8 value holes
    rx: re.Pattern[bytes]


def _skeleton_spans(module: str, shape: str) -> list[bytes]:
    """The fixed spans of the protocol 4/5 pickle `pickle.dumps` writes for KvMetrics after
    PROTO [FRAME] (`shape` "object": plain class or dataclass, NEWOBJ + BUILD; "struct": msgspec's
    `rebuild(cls, state)` REDUCE), cut at the eight value holes."""

    def text(s: str) -> bytes:
        b = s.encode()
        if len(b) < 256:
            return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b
        return pickle.BINUNICODE + len(b).to_bytes(4, "little") + b

    def global_(mod: str, name: str) -> bytes:
        return text(mod) + pickle.MEMOIZE + text(name) + pickle.MEMOIZE + pickle.STACK_GLOBAL + pickle.MEMOIZE

    if shape == "object":
        out = global_(module, "KvMetrics") + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.MEMOIZE
    else:
        out = global_(*_MSGSPEC_REBUILD) + global_(module, "KvMetrics")
    out += pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.MARK
    spans = []
    for name in KV_METRICS_FIELDS:
        spans.append(out + text(name) + pickle.MEMOIZE)
        out = b""
    out += pickle.SETITEMS
    if shape == "object":
        out += pickle.BUILD
    else:
        out += pickle.TUPLE2 + pickle.MEMOIZE + pickle.REDUCE + pickle.MEMOIZE
    spans.append(out + pickle.STOP)
    return spans


# Value holes. Ints: BININT1, BININT2, BININT with the sign bit clear, LONG1 of 1–8 bytes with the
# sign bit clear — i.e. exactly 0 … 2**63-1. The capture is the little-endian magnitude alone (the
# look-behinds tie its length to the opcode), so `int.from_bytes(g, "little")` reads every form.
_INT_OPS = rb"(?:K|M|J|\x8a[\x01-\x08])"
_INT_PAYLOADS = [rb"(?<=K).", rb"(?<=M)..", rb"(?<=J)...[\x00-\x7f]"] + [
    rb"(?<=\x8a" + re.escape(bytes([n])) + rb")" + rb"." * (n - 1) + rb"[\x00-\x7f]" for n in range(1, 9)
]
_INT_HOLE = _INT_OPS + rb"(" + rb"|".join(_INT_PAYLOADS) + rb")"
# data_parallel_rank may also be None (old plain classes): NONE captures b"" → 0, as the safe path maps it
_RANK_HOLE = rb"(?:" + _INT_OPS + rb"|N)(" + rb"|".join(_INT_PAYLOADS) + rb"|(?<=N))"
# Fractions: BINFLOAT (big-endian IEEE 754) in [0.0, 1.0], or -0.0 (pydantic's ge=0 accepts it).
_FRACTION_HOLE = rb"G((?:[\x00-\x3e].{7}|\x3f[\x00-\xef].{6}|\x3f\xf0\x00{6}|\x80\x00{7}))"
_HOLES = [
    _FRACTION_HOLE if f.startswith("gpu_") else _RANK_HOLE if f == "data_parallel_rank" else _INT_HOLE
    for f in KV_METRICS_FIELDS
]


def _build_skeletons() -> tuple[int, dict[bytes, _Skeleton], dict[bytes, _Skeleton]]:
    spans = {(m, shape): _skeleton_spans(m, shape) for m in KV_METRICS_MODULES for shape in ("object", "struct")}
    window = min(len(s[0]) for s in spans.values())  # the first span is never shorter: no value in it
    after_frame: dict[bytes, _Skeleton] = {}  # with FRAME: the window starts at byte 11
    after_proto: dict[bytes, _Skeleton] = {}  # without FRAME (allowed by pickle): at byte 2
    for sp in spans.values():
        fixed = (sp[0][window:], *sp[1:])
        rx = re.compile(
            b"".join(b"(.{%d})" % len(f) + hole for f, hole in zip(fixed, _HOLES)) + b"(.{%d})" % len(fixed[-1]),
            re.DOTALL,
        )
        sk = _Skeleton(frozenset((4, 5)), sp[0][:window], fixed, rx)
        for table in (after_frame, after_proto):
            assert sk.window not in table, "ambiguous skeleton window"
            table[sk.window] = sk
    return window, after_frame, after_proto


_WINDOW, _SKELETONS_AFTER_FRAME, _SKELETONS_AFTER_PROTO = _build_skeletons()
_MIN_FAST = 11 + _WINDOW
_MAX_FAST = 2048  # SGLang's KvMetrics pickles are 250–450 bytes
_FRAME_LENGTHS = [max(0, n - 11).to_bytes(8, "little") for n in range(_MAX_FAST + 1)]
_unpack_double = struct.Struct(">d").unpack
_from_bytes = int.from_bytes
_FRAME_OP = pickle.FRAME[0]


def _fast_pickle_values(frame: bytes) -> tuple[bytes, ...] | None:
    """The eight value captures if `frame` is exactly one of SGLang's KvMetrics pickles, else None."""
    size = len(frame)
    if size < _MIN_FAST:
        return None
    if frame[2] == _FRAME_OP:
        if size > _MAX_FAST or frame[3:11] != _FRAME_LENGTHS[size]:  # one frame, exactly the rest
            return None
        sk = _SKELETONS_AFTER_FRAME.get(frame[11:11 + _WINDOW])
        start = 11
    else:
        sk = _SKELETONS_AFTER_PROTO.get(frame[2:2 + _WINDOW])
        start = 2
    if sk is None or frame[1] not in sk.protocols:
        return None
    m = sk.rx.fullmatch(frame, start + _WINDOW)
    if m is None:
        return None
    g = m.groups()
    if g[0::2] != sk.fixed:
        return None
    return g[1::2]


# The holes above admit only in-range values, so the pydantic model's checks (strict int 0 … 2**63-1,
# strict float in [0, 1], finite) already hold: build the instance without re-checking them.
_FIELDS_SET = frozenset(KV_METRICS_FIELDS)
_new_model = object.__new__
_set_slot = object.__setattr__


def _trusted_constructed(a: int, b: int, c: int, d: int, e: int, f: float, g: float, rank: int | None) -> KvMetrics:
    m = _new_model(KvMetrics)
    _set_slot(m, "__dict__", {
        "request_active_slots": a, "request_total_slots": b, "kv_active_blocks": c, "kv_total_blocks": d,
        "num_requests_waiting": e, "gpu_cache_usage_perc": f, "gpu_prefix_cache_hit_rate": g,
        "data_parallel_rank": rank or 0,
    })
    _set_slot(m, "__pydantic_fields_set__", set(_FIELDS_SET))
    _set_slot(m, "__pydantic_extra__", None)
    _set_slot(m, "__pydantic_private__", None)
    return m


def _trusted_validated(a: int, b: int, c: int, d: int, e: int, f: float, g: float, rank: int | None) -> KvMetrics:
    return _validator.validate_python({
        "request_active_slots": a, "request_total_slots": b, "kv_active_blocks": c, "kv_total_blocks": d,
        "num_requests_waiting": e, "gpu_cache_usage_perc": f, "gpu_prefix_cache_hit_rate": g,
        "data_parallel_rank": rank or 0,
    })


def _model_checks_are_the_holes() -> bool:
    """The fast constructor is used only while KvMetrics' validation is exactly what the value holes
    admit (strict ints 0 … INT64_MAX, strict finite floats in [0, 1], rank default 0) and runs no
    code of its own; change the model and decoding goes back through its validator."""
    schema = KvMetrics.__pydantic_core_schema__
    if schema.get("type") != "model" or schema.get("custom_init") or schema.get("post_init"):
        return False
    fields = schema["schema"]["fields"]
    count = {"type": "int", "strict": True, "ge": 0, "le": INT64_MAX}
    fraction = {"type": "float", "strict": True, "ge": 0.0, "le": 1.0, "allow_inf_nan": False}
    want = {f: fraction if f.startswith("gpu_") else count for f in KV_METRICS_FIELDS}
    want["data_parallel_rank"] = {"type": "default", "schema": count, "default": 0}
    got = {name: f["schema"] for name, f in fields.items()}
    decorators = KvMetrics.__pydantic_decorators__
    return (
        got == want
        and all(f["type"] == "model-field" for f in fields.values())
        and not any((decorators.validators, decorators.field_validators, decorators.root_validators,
                     decorators.model_validators, decorators.computed_fields))
        and not KvMetrics.__private_attributes__
    )


_trusted = _trusted_constructed if _model_checks_are_the_holes() else _trusted_validated

_Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
_Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # NaN fails both bounds; inf fails one


class _KvMetricsArray(msgspec.Struct, tag="KvMetrics", array_like=True, forbid_unknown_fields=True):
    """The msgpack form's structure and ranges, checked by msgspec in C (no defaults: arity is 9)."""

    request_active_slots: _Count
    request_total_slots: _Count
    kv_active_blocks: _Count
    kv_total_blocks: _Count
    num_requests_waiting: _Count
    gpu_cache_usage_perc: _Fraction
    gpu_prefix_cache_hit_rate: _Fraction
    data_parallel_rank: _Count | None


_typed_msgpack_decode = msgspec.msgpack.Decoder(_KvMetricsArray).decode
_astuple = msgspec.structs.astuple


def decode_kv_metrics(frame: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> KvMetrics:
    """Decode one frame as any SGLang release 0.4.9 … 0.5.23 sends it.

    Raises `WireError` (a `ValueError`, with `.reason`) for oversized, malformed, foreign or
    out-of-range frames. Never calls code named by the frame.
    """
    if type(frame) is not bytes:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise WireError("bad_type", f"frame is {type(frame).__name__}, not bytes")
        frame = bytes(frame)
    size = len(frame)
    if size > max_bytes:
        raise WireError("oversized", f"{size} bytes > limit {max_bytes}")
    if size == 0:
        raise WireError("empty", "zero-length frame")
    first = frame[0]
    if first == _PICKLE_PROTO:
        v = _fast_pickle_values(frame)
        if v is not None:  # exactly SGLang's pickle, every value already in range (see above)
            return _trusted(
                _from_bytes(v[0], "little"), _from_bytes(v[1], "little"), _from_bytes(v[2], "little"),
                _from_bytes(v[3], "little"), _from_bytes(v[4], "little"), _unpack_double(v[5])[0],
                _unpack_double(v[6])[0], _from_bytes(v[7], "little"),
            )
        fields = _fields_from_pickle(frame)
    elif first == _MSGPACK_ARRAY_9 or first in (0xDC, 0xDD) or 0x90 <= first <= 0x9F:
        try:
            s = _typed_msgpack_decode(frame)
        except Exception:  # anything unusual: the generic path decides, with its own reason
            pass
        else:
            return _trusted(*_astuple(s))
        fields = _fields_from_msgpack(frame)
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
