"""actors.wire.kv_metrics: every SGLang release's KvMetrics frame decodes; nothing else does, and nothing runs."""

from __future__ import annotations

import math
import os
import pickle
import pickletools
import subprocess
import sys

import msgspec
import pytest

from actors.models import KV_METRICS_FIELDS, KvMetrics
from actors.wire import KV_METRICS_MODULES, WireError, decode_kv_metrics
from sim.sglang_shapes import WIRE_FORMS, encode_kv_metrics, kv_metrics_class, make_kv_metrics

VALUES = dict(
    request_active_slots=7,
    request_total_slots=48,
    kv_active_blocks=12_345,
    kv_total_blocks=500_000,
    num_requests_waiting=3,
    gpu_cache_usage_perc=0.0247,
    gpu_prefix_cache_hit_rate=0.625,
    data_parallel_rank=1,
)


@pytest.mark.parametrize("form", sorted(WIRE_FORMS))
def test_every_release_form_decodes_to_the_sent_values(form):
    m = decode_kv_metrics(encode_kv_metrics(form, **VALUES))
    assert m.model_dump() == VALUES


@pytest.mark.parametrize("form", [f for f in WIRE_FORMS if WIRE_FORMS[f][2] is not None])
def test_pickled_frames_name_the_real_module_path(form):
    frame = encode_kv_metrics(form, **VALUES)
    module = WIRE_FORMS[form][0]
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(frame)]
    strings = [arg for name, arg in ops if name.endswith("UNICODE")]
    assert module in strings and "KvMetrics" in strings
    if WIRE_FORMS[form][1] == "struct":  # msgspec rebuilds Structs through its own helper
        assert "msgspec._utils" in strings and "rebuild" in strings


def test_all_reference_module_paths_are_allowed():
    assert {WIRE_FORMS[f][0] for f in WIRE_FORMS} == set(KV_METRICS_MODULES)


def test_msgpack_form_is_the_tagged_positional_array():
    frame = encode_kv_metrics("0.5.23-msgpack", **VALUES)
    assert msgspec.msgpack.decode(frame) == ["KvMetrics", *[VALUES[f] for f in KV_METRICS_FIELDS]]


def test_old_plain_class_with_unset_dp_rank_means_rank_zero():
    obj = make_kv_metrics("0.4.9", **{k: v for k, v in VALUES.items() if k != "data_parallel_rank"})
    assert obj.data_parallel_rank is None
    assert decode_kv_metrics(pickle.dumps(obj, protocol=4)).data_parallel_rank == 0


def test_decoder_needs_neither_sglang_nor_torch():
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('sglang', 'torch'): raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "from actors.wire import decode_kv_metrics\n"
        f"frame = bytes.fromhex('{encode_kv_metrics('0.5.23', **VALUES).hex()}')\n"
        "print(decode_kv_metrics(frame).kv_active_blocks)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(VALUES["kv_active_blocks"])


# --- hostile frames: refused, and nothing executes ---------------------------------------------


class _WritesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _RunsShell:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _EvalsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (eval, (f"open({self.path!r}, 'w')",))


@pytest.mark.parametrize("payload", [_WritesFile, _RunsShell, _EvalsCode])
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_malicious_pickles_are_refused_and_create_no_file(tmp_path, payload, protocol):
    target = tmp_path / "pwned"
    frame = pickle.dumps(payload(str(target)), protocol=protocol)
    with pytest.raises(WireError) as err:
        decode_kv_metrics(frame)
    assert err.value.reason == "forbidden_global"
    assert not target.exists()


def test_malicious_payload_hidden_inside_a_kvmetrics_state_is_refused(tmp_path):
    target = tmp_path / "pwned"
    obj = make_kv_metrics("0.5.8", **VALUES)
    obj.request_active_slots = _RunsShell(str(target))
    with pytest.raises(WireError) as err:
        decode_kv_metrics(pickle.dumps(obj, protocol=4))
    assert err.value.reason == "forbidden_global"
    assert not target.exists()


def test_msgspec_struct_of_another_class_is_refused():
    import types

    mod = types.ModuleType("kvroute_test_foreign")
    sys.modules[mod.__name__] = mod

    class Other(msgspec.Struct, tag=True, kw_only=True, array_like=True):
        x: int = 1

    Other.__module__ = mod.__name__
    Other.__qualname__ = "Other"
    mod.Other = Other
    frame = pickle.dumps(Other(), protocol=5)
    assert b"msgspec._utils" in frame  # the same rebuild helper SGLang's Struct uses
    with pytest.raises(WireError) as err:
        decode_kv_metrics(frame)
    assert err.value.reason == "forbidden_global"


@pytest.mark.parametrize(
    "obj, reason",
    [
        ({"request_active_slots": 1}, "not_kv_metrics"),
        ([1, 2, 3], "not_kv_metrics"),
        ("KvMetrics", "not_kv_metrics"),
        (None, "not_kv_metrics"),
    ],
)
def test_pickles_of_other_objects_are_refused(obj, reason):
    with pytest.raises(WireError) as err:
        decode_kv_metrics(pickle.dumps(obj, protocol=4))
    assert err.value.reason == reason


@pytest.mark.parametrize(
    "field, value",
    [
        ("request_active_slots", -1),
        ("kv_active_blocks", 1.5),
        ("num_requests_waiting", "3"),
        ("request_total_slots", True),
        ("gpu_cache_usage_perc", math.nan),
        ("gpu_cache_usage_perc", math.inf),
        ("gpu_cache_usage_perc", 1.01),
        ("gpu_prefix_cache_hit_rate", -0.1),
        ("gpu_prefix_cache_hit_rate", "0.5"),
        ("data_parallel_rank", -2),
    ],
)
@pytest.mark.parametrize("form", ["0.5.8", "0.5.12", "0.5.23", "0.5.23-msgpack"])
def test_out_of_range_or_wrong_typed_values_are_refused_with_the_field_named(form, field, value):
    cls = kv_metrics_class(form)
    obj = make_kv_metrics(form, **VALUES)
    object.__setattr__(obj, field, value) if WIRE_FORMS[form][1] != "struct" else None
    if WIRE_FORMS[form][1] == "struct":
        obj = cls(**{**VALUES, field: value})  # msgspec Structs do not type-check on init
        frame = msgspec.msgpack.encode(obj) if WIRE_FORMS[form][2] is None else pickle.dumps(obj, protocol=5)
    else:
        frame = pickle.dumps(obj, protocol=4)
    with pytest.raises(WireError) as err:
        decode_kv_metrics(frame)
    assert err.value.reason == "invalid_value"
    assert field in str(err.value)


def test_missing_field_is_refused():
    obj = make_kv_metrics("0.5.8", **VALUES)
    del obj.kv_total_blocks
    with pytest.raises(WireError) as err:
        decode_kv_metrics(pickle.dumps(obj, protocol=4))
    assert "kv_total_blocks" in str(err.value)


def test_extra_field_is_refused():
    obj = make_kv_metrics("0.5.8", **VALUES)
    obj.surprise = 1
    with pytest.raises(WireError) as err:
        decode_kv_metrics(pickle.dumps(obj, protocol=4))
    assert err.value.reason == "unknown_field"


def test_oversized_frames_are_refused_unparsed():
    big = encode_kv_metrics("0.5.8", **VALUES) + b"\x00" * (64 * 1024)
    with pytest.raises(WireError) as err:
        decode_kv_metrics(big)
    assert err.value.reason == "oversized"
    small_limit = encode_kv_metrics("0.5.23", **VALUES)
    with pytest.raises(WireError):
        decode_kv_metrics(small_limit, max_bytes=len(small_limit) - 1)
    assert decode_kv_metrics(small_limit, max_bytes=len(small_limit)).request_active_slots == 7


@pytest.mark.parametrize("frame", [b"", b"\x00", b"hello", b"\x80", b"\x80\x05garbage", b"\x99\xa9KvMetrics", b"\xc1"])
def test_garbage_and_truncated_frames_are_refused(frame):
    with pytest.raises(WireError):
        decode_kv_metrics(frame)


def test_every_truncation_of_a_valid_frame_is_refused_cleanly():
    for form in WIRE_FORMS:
        frame = encode_kv_metrics(form, **VALUES)
        for cut in range(len(frame) - 1):
            with pytest.raises(WireError):
                decode_kv_metrics(frame[:cut])


def test_msgpack_with_wrong_tag_or_arity_is_refused():
    with pytest.raises(WireError) as err:
        decode_kv_metrics(msgspec.msgpack.encode(["LoadStat", 1, 2, 3, 4, 5, 0.1, 0.2, 0]))
    assert err.value.reason == "bad_msgpack"
    with pytest.raises(WireError):
        decode_kv_metrics(msgspec.msgpack.encode(["KvMetrics", 1, 2]))


def test_wire_error_is_a_value_error_with_a_reason():
    with pytest.raises(ValueError):
        decode_kv_metrics(b"nope")
    assert issubclass(WireError, ValueError)


def test_kv_metrics_model_has_exactly_sglangs_eight_fields():
    assert tuple(KvMetrics.model_fields) == KV_METRICS_FIELDS
    assert len(KV_METRICS_FIELDS) == 8


def test_a_huge_memo_index_is_refused_before_the_unpickler_allocates():
    # LONG_BINPUT 2**25 would make the C unpickler zero-fill a 512 MiB memo
    with pytest.raises(WireError) as err:
        decode_kv_metrics(b"\x80\x04Nr\x00\x00\x00\x02.")
    assert err.value.reason == "bad_pickle" and "0x72" in str(err.value)


def test_a_deeply_nested_value_is_refused_without_rendering_it():
    obj = make_kv_metrics("0.5.8", **VALUES)
    nested: list = []
    for _ in range(200):  # 2**200 elements if rendered; that rendering it would be costly; pickle can still write it
        nested = [nested, nested]
    obj.request_active_slots = nested
    with pytest.raises(WireError) as err:
        decode_kv_metrics(pickle.dumps(obj, protocol=4), max_bytes=1 << 20)
    assert err.value.reason == "invalid_value" and "a list" in str(err.value)


def test_counts_beyond_int64_are_refused():
    with pytest.raises(WireError) as err:
        decode_kv_metrics(encode_kv_metrics("0.5.23", **{**VALUES, "num_requests_waiting": 10**400}))
    assert err.value.reason == "invalid_value" and "num_requests_waiting" in str(err.value)


# --- fast path: SGLang's exact pickles skip the unpickler; it must agree with the safe path -------

import random  # noqa: E402

from actors.wire import kv_metrics as wire  # noqa: E402

PICKLE_FORMS = [f for f in WIRE_FORMS if WIRE_FORMS[f][2] is not None]
INT_FIELDS = [f for f in KV_METRICS_FIELDS if not f.startswith("gpu_")]
FRACTION_FIELDS = [f for f in KV_METRICS_FIELDS if f.startswith("gpu_")]
EDGE_INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**56 - 1, 2**56, 2**63 - 1,
             2**63, 2**64, 10**30, -1, -255, -256, -65536, -2**31, -2**31 - 1, -2**63, -2**64]
EDGE_FLOATS = [0.0, -0.0, 1.0, 0.5, 1e-300, 5e-324, math.nextafter(1.0, 0.0), math.nextafter(1.0, 2.0), -5e-324,
               -1e-300, 1.01, 2.0, -0.1, math.nan, -math.nan, math.inf, -math.inf]


def _outcome(fn, frame):
    """What a decoder makes of a frame, comparable across paths (repr keeps -0.0 apart from 0.0)."""
    try:
        m = fn(frame)
    except WireError as exc:
        return ("refused", exc.reason, str(exc))
    assert type(m) is KvMetrics
    return ("accepted", repr(m.model_dump()), sorted(m.model_fields_set))


def _no_typed_msgpack(frame):
    raise msgspec.DecodeError("fast path off")


def _safe_path(frame):
    """The decoder with its fast paths switched off: opcode walk + allow-list unpickler (or generic
    msgpack) + the pydantic validator, exactly as before the fast paths existed."""
    saved = wire._fast_pickle_values, wire._typed_msgpack_decode
    wire._fast_pickle_values, wire._typed_msgpack_decode = (lambda frame: None), _no_typed_msgpack
    try:
        return decode_kv_metrics(frame)
    finally:
        wire._fast_pickle_values, wire._typed_msgpack_decode = saved


def _pickle_frame(form, protocol, values):
    if WIRE_FORMS[form][1] == "struct":  # msgspec Structs do not type-check on init
        return pickle.dumps(kv_metrics_class(form)(**{**VALUES, **values}), protocol=protocol)
    obj = make_kv_metrics(form, **VALUES)
    for k, v in values.items():
        object.__setattr__(obj, k, v)
    return pickle.dumps(obj, protocol=protocol)


def _random_values(rng):
    def count():
        return rng.choice([rng.randrange(256), rng.randrange(65536), rng.randrange(2**31), rng.randrange(2**63),
                           rng.choice(EDGE_INTS)])

    def fraction():
        return rng.choice([rng.random(), round(rng.random(), 2), 0.0, 1.0, rng.choice(EDGE_FLOATS)])

    out = {f: count() for f in INT_FIELDS}
    out.update({f: fraction() for f in FRACTION_FIELDS})
    if rng.random() < 0.2:
        out["data_parallel_rank"] = None
    return out


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("form", PICKLE_FORMS)
def test_every_sglang_pickle_takes_the_fast_path(form, protocol):
    frame = _pickle_frame(form, protocol, {})
    assert wire._fast_pickle_values(frame) is not None
    assert decode_kv_metrics(frame).model_dump() == VALUES


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("form", PICKLE_FORMS)
def test_protocol_2_and_3_pickles_stay_refused_as_before(form, protocol):
    # they name the class with GLOBAL, which the opcode walk refuses; the fast path must not change that
    frame = _pickle_frame(form, protocol, {})
    assert wire._fast_pickle_values(frame) is None
    with pytest.raises(WireError) as err:
        decode_kv_metrics(frame)
    assert err.value.reason == "forbidden_global"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("form", PICKLE_FORMS)
def test_fast_and_safe_paths_agree_on_edge_values_of_every_field(form, protocol):
    for field in KV_METRICS_FIELDS:
        values = EDGE_FLOATS if field in FRACTION_FIELDS else EDGE_INTS
        for value in [*values, True, False, None]:
            frame = _pickle_frame(form, protocol, {field: value})
            got, want = _outcome(decode_kv_metrics, frame), _outcome(_safe_path, frame)
            assert got == want, (form, protocol, field, value)
            if want[0] == "refused":  # every refusal comes from the safe path, never the fast one
                assert wire._fast_pickle_values(frame) is None, (field, value)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("form", PICKLE_FORMS)
def test_fast_and_safe_paths_agree_on_random_values(form, protocol):
    rng = random.Random(f"{form}/{protocol}")
    fast = 0
    for _ in range(300):
        frame = _pickle_frame(form, protocol, _random_values(rng))
        got, want = _outcome(decode_kv_metrics, frame), _outcome(_safe_path, frame)
        assert got == want
        fast += wire._fast_pickle_values(frame) is not None
    assert fast > 100 if protocol >= 4 else fast == 0  # in-range reports take it; protocol 2/3 never


def test_bools_are_not_counts_on_the_fast_path_either():
    for form in PICKLE_FORMS:
        frame = _pickle_frame(form, 5, {"request_active_slots": True})
        assert b"\x88" in frame  # NEWTRUE
        with pytest.raises(WireError) as err:
            decode_kv_metrics(frame)
        assert err.value.reason == "invalid_value" and "request_active_slots" in str(err.value)


def test_fast_path_reads_every_int_opcode_and_the_none_rank():
    for value, opcode in [(200, b"K"), (60000, b"M"), (2**31 - 1, b"J"), (2**31, b"\x8a"), (2**63 - 1, b"\x8a")]:
        frame = _pickle_frame("0.5.23", 5, {"kv_total_blocks": value, "data_parallel_rank": None})
        ops = [op.name for op, _, _ in pickletools.genops(frame)]
        assert {"BININT1": b"K", "BININT2": b"M", "BININT": b"J", "LONG1": b"\x8a"}.keys() & set(ops)
        assert opcode in frame
        assert wire._fast_pickle_values(frame) is not None
        m = decode_kv_metrics(frame)
        assert m.kv_total_blocks == value and m.data_parallel_rank == 0


def test_every_single_byte_change_of_a_fast_path_frame_decodes_as_the_safe_path_does():
    rng = random.Random(7)
    for form in PICKLE_FORMS:
        for protocol in (4, 5):
            frame = _pickle_frame(form, protocol, {})
            for i in range(len(frame)):
                for b in {0x00, 0x7F, 0x80, 0xFF, frame[i] ^ 1, rng.randrange(256)} - {frame[i]}:
                    bad = frame[:i] + bytes([b]) + frame[i + 1:]
                    assert _outcome(decode_kv_metrics, bad) == _outcome(_safe_path, bad), (form, protocol, i, b)


def _ops(frame):
    return [(op, pos) for op, _, pos in pickletools.genops(frame)]


@pytest.mark.parametrize("form", PICKLE_FORMS)
def test_tampered_fast_path_frames_go_to_the_safe_path(form):
    frame = _pickle_frame(form, 5, {})
    setitems = frame.rindex(b"u")
    # extra opcodes (a value pushed and popped, a memo put) inside an otherwise exact frame
    for extra in (b"N0", b"K\x010", b"q\x63", b"\x94", b"h\x00" + b"0"):
        bad = frame[:setitems] + extra + frame[setitems:]
        assert wire._fast_pickle_values(bad) is None
        assert _outcome(decode_kv_metrics, bad) == _outcome(_safe_path, bad)
    # a memo put with a huge index (LONG_BINPUT): refused before the unpickler could allocate
    first_put = frame.index(b"\x94")
    bad = frame[:first_put] + b"r\x00\x00\x00\x08" + frame[first_put + 1:]
    with pytest.raises(WireError) as err:
        decode_kv_metrics(bad)
    assert err.value.reason == "bad_pickle"
    # trailing bytes after STOP: never the fast path (the safe path decides, as it always has)
    assert wire._fast_pickle_values(frame + b"N") is None
    assert _outcome(decode_kv_metrics, frame + b"N") == _outcome(_safe_path, frame + b"N")


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("form", PICKLE_FORMS)
def test_a_foreign_global_of_the_same_length_is_refused(form, protocol, tmp_path):
    frame = _pickle_frame(form, protocol, {})
    module = WIRE_FORMS[form][0].encode()
    for fake_mod, fake_name in [(module[:-1] + b"X", b"KvMetrics"), (module, b"KvMetricX"), (b"os".ljust(len(module), b" "), b"KvMetrics")]:
        bad = frame.replace(module, fake_mod).replace(b"KvMetrics", fake_name)
        assert len(bad) == len(frame) and bad != frame
        assert wire._fast_pickle_values(bad) is None
        with pytest.raises(WireError) as err:
            decode_kv_metrics(bad)
        assert err.value.reason == "forbidden_global"
    if WIRE_FORMS[form][1] == "struct":
        bad = frame.replace(b"rebuild", b"rebuilt")
        with pytest.raises(WireError) as err:
            decode_kv_metrics(bad)
        assert err.value.reason == "forbidden_global"


def test_a_frame_header_that_does_not_cover_the_rest_is_not_the_fast_path():
    frame = _pickle_frame("0.5.23", 5, {})
    n = int.from_bytes(frame[3:11], "little")
    for k in (n - 1, n + 1, n + 2**40):
        bad = frame[:3] + k.to_bytes(8, "little") + frame[11:]
        assert wire._fast_pickle_values(bad) is None
        assert _outcome(decode_kv_metrics, bad) == _outcome(_safe_path, bad)
    unframed = frame[:2] + frame[11:]  # protocol 4/5 without FRAME: still exact, still fast
    assert wire._fast_pickle_values(unframed) is not None
    assert _outcome(decode_kv_metrics, unframed) == _outcome(_safe_path, unframed)


def test_reordered_or_unmemoized_pickles_are_still_accepted_by_the_safe_path():
    obj = make_kv_metrics("0.5.8", **VALUES)
    # pickletools.optimize drops the unused memo puts: not a fast-path layout, same result
    frame = pickletools.optimize(pickle.dumps(obj, protocol=4))
    assert wire._fast_pickle_values(frame) is None
    assert decode_kv_metrics(frame).model_dump() == VALUES
    # another field order (a class that assigns attributes in another order)
    obj2 = make_kv_metrics("0.5.8", **VALUES)
    obj2.__dict__ = dict(reversed(list(obj2.__dict__.items())))
    frame = pickle.dumps(obj2, protocol=4)
    assert wire._fast_pickle_values(frame) is None
    assert decode_kv_metrics(frame).model_dump() == VALUES


def test_fast_constructed_models_are_the_validated_models():
    assert wire._trusted is wire._trusted_constructed  # KvMetrics' checks are exactly the holes'
    rng = random.Random(3)
    for _ in range(200):
        args = [rng.randrange(2**63) for _ in range(5)] + [rng.random(), rng.random(), rng.randrange(8)]
        fast, validated = wire._trusted_constructed(*args), wire._trusted_validated(*args)
        assert fast == validated and hash(fast) == hash(validated)
        assert fast.model_dump() == validated.model_dump() and fast.model_fields_set == validated.model_fields_set
        assert repr(fast) == repr(validated)
        assert pickle.loads(pickle.dumps(fast)) == validated
        assert fast.model_copy(update={"request_active_slots": 1}).request_active_slots == 1
        with pytest.raises(Exception):
            fast.request_active_slots = 3  # still frozen


def test_msgpack_typed_and_generic_paths_agree():
    rng = random.Random(11)
    kvm = kv_metrics_class("0.5.23-msgpack")
    cases = []
    for field in KV_METRICS_FIELDS:
        values = EDGE_FLOATS if field in FRACTION_FIELDS else [v for v in EDGE_INTS if -2**63 <= v < 2**64]
        cases += [{**VALUES, field: v} for v in [*values, True, False, None, "3", 1.5, 0, 1]]
    cases += [_random_values(rng) for _ in range(500)]
    for values in cases:
        try:
            frame = msgspec.msgpack.encode(kvm(**values))
        except OverflowError:  # msgpack has no ints beyond (u)int64
            continue
        assert _outcome(decode_kv_metrics, frame) == _outcome(_safe_path, frame), values
    enc = msgspec.msgpack.encode
    base = [VALUES[f] for f in KV_METRICS_FIELDS]
    for arr in (["KvMetrics", *base, 0], ["KvMetrics", *base[:-1]], ["KvMetric", *base], [1, *base],
                ["KvMetrics", *base[:5], 1, 0.5, 0]):
        frame = enc(arr)
        assert _outcome(decode_kv_metrics, frame) == _outcome(_safe_path, frame), arr
    assert _outcome(decode_kv_metrics, enc(["KvMetrics", *base]) + b"\x00")[0] == "refused"


def test_bytes_like_frames_decode_the_same():
    for form in WIRE_FORMS:
        frame = encode_kv_metrics(form, **VALUES)
        for view in (bytearray(frame), memoryview(frame)):
            assert decode_kv_metrics(view).model_dump() == VALUES
