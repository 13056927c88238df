"""actors.wire: every SGLang release's KvMetrics frame decodes; nothing else does, and nothing runs."""

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
