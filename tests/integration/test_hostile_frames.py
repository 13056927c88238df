"""Hostile metrics frames against a LIVE worker actor, while a valid emitter pushes steadily.

Specification: a worker actor fed >10,000 hostile frames (noise, truncated and malicious pickles,
foreign classes, out-of-range values in every SGLang wire form, oversized frames, multipart
messages) does not crash, runs nothing, counts every refusal under its reason exactly, accepts
exactly the valid frames, and keeps the valid stream fresh and exact.

The reason a frame is refused under follows the decoder's order of checks, which the corpus
categories are built around: size → first byte (pickle PROTO / msgpack array / neither) → every
pickle opcode is one SGLang's KvMetrics pickles use (else `bad_pickle`; opcodes that name code →
`forbidden_global`) → globals through the allow-list (`forbidden_global`) → the object is a
KvMetrics (`not_kv_metrics`) → field names (`unknown_field`) and values (`invalid_value`).

Bounded: the fuzz run stops waiting after 30 s (it needs ~1 s); the module takes ~30 s on 2 cores.
"""

from __future__ import annotations

import collections
import copyreg
import dataclasses
import datetime
import decimal
import math
import os
import pickle
import pickletools
import random
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from actors.models import KV_METRICS_FIELDS
from sim.sglang_shapes import WIRE_FORMS, encode_kv_metrics, kv_metrics_class, make_kv_metrics
from tests.integration.helpers import HealthServer, wait_for

pytestmark = pytest.mark.ray

MAX_FRAME = 64 * 1024  # Settings.max_frame_bytes default
HARD_LIMIT = 16 * MAX_FRAME  # ZMQ MAXMSGSIZE on the PULL: above this the peer is disconnected
MULTIPART = "multipart"
SEED = 20240611
ROUNDS = 3  # the fuzz run sends the ~12,300-frame corpus this many times

# Values the hostile frames are built around: never sent by the valid stream (kv_active_blocks is
# far above it), so an accidental acceptance would show in `latest`.
HOSTILE_BASE = dict(
    request_active_slots=3, request_total_slots=64, kv_active_blocks=999_999_999, kv_total_blocks=1_000_000_000,
    num_requests_waiting=1, gpu_cache_usage_perc=0.5, gpu_prefix_cache_hit_rate=0.25, data_parallel_rank=0,
)
PICKLE_FORMS = [f for f in WIRE_FORMS if WIRE_FORMS[f][2] is not None]
INT_FIELDS = [f for f in KV_METRICS_FIELDS if not f.startswith("gpu_")]
FRACTION_FIELDS = [f for f in KV_METRICS_FIELDS if f.startswith("gpu_")]


# --- payloads that would create a file if they were ever executed ---------------------------------


class _Call:
    """Pickles as REDUCE(fn, args): `fn(*args)` runs at load time under a plain unpickler."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)

    def __call__(self, *a: Any) -> Any:  # pickle insists REDUCE targets are callable; never called here
        raise AssertionError("never called in the test process")


def _file_creators(path: str) -> list[Any]:
    """Objects whose unpickling (by a plain `pickle.loads`) creates `path`."""
    touch = f"touch {path}"
    return [
        _Call(os.system, touch),
        _Call(open, path, "w"),
        _Call(eval, f"open({path!r}, 'w')"),
        _Call(exec, f"open({path!r}, 'w').close()"),
        _Call(subprocess.Popen, ["touch", path]),
        _Call(subprocess.call, ["touch", path]),
        _Call(subprocess.check_call, ["touch", path]),
        _Call(subprocess.run, ["touch", path]),
        _Call(os.popen, touch),
        # builtins reached indirectly: __import__('os').system(...) through getattr
        _Call(_Call(getattr, _Call(__import__, "os"), "system"), touch),
        # copyreg / functools gadgets that end in a call
        _Call(copyreg._reconstructor, object, object, None),
        _Call(_Call(getattr, _Call(__import__, "subprocess"), "getoutput"), touch),
    ]


def _global_of(fn: Any) -> tuple[str, str]:
    return (getattr(fn, "__module__", None) or pickle.whichmodule(fn, fn.__name__), fn.__qualname__)


def _ext_code_pickles(path: str) -> list[bytes]:
    """Pickles that name os.system / eval / exec / open by copyreg extension codes (EXT1/EXT2/EXT4
    opcodes) instead of by module path, as registered in the sender's process."""
    out: list[bytes] = []
    targets = [(os.system, f"touch {path}"), (eval, f"open({path!r}, 'w')"), (exec, f"open({path!r},'w')")]
    for code in (0x7B, 0x1234, 0x12345):  # one code per opcode width: EXT1, EXT2, EXT4
        for fn, arg in targets:
            module, name = _global_of(fn)
            copyreg.add_extension(module, name, code)
            try:
                for proto in (2, 3, 4, 5):
                    frame = pickle.dumps(_Call(fn, arg), protocol=proto)
                    assert frame[0] == 0x80 and any(op.name.startswith("EXT") for op, _, _ in pickletools.genops(frame))
                    out.append(frame)
            finally:
                copyreg.remove_extension(module, name, code)
    return out


# --- the corpus --------------------------------------------------------------------------------


def _invalid_value_frame(form: str, field: str, value: Any) -> bytes:
    shape, proto = WIRE_FORMS[form][1], WIRE_FORMS[form][2]
    if shape == "struct":  # msgspec Structs do not type-check on init
        obj = kv_metrics_class(form)(**{**HOSTILE_BASE, field: value})
        return msgspec.msgpack.encode(obj) if proto is None else pickle.dumps(obj, protocol=proto)
    obj = make_kv_metrics(form, **HOSTILE_BASE)
    object.__setattr__(obj, field, value)
    return pickle.dumps(obj, protocol=proto)


def _bad_values(field: str, form: str, rng: random.Random) -> list[Any]:
    """Values SGLang never sends, each in an otherwise valid frame of `form` (all → invalid_value)."""
    common: list[Any] = [math.nan, math.inf, -math.inf, "3", [], {}, True, [1], {"a": 1}]
    if WIRE_FORMS[form][2] is None:  # bytes are a msgpack value; in a pickle, an opcode SGLang never uses
        common.append(b"\x00")
    if field in FRACTION_FIELDS:
        return common + [-0.1, 1.0000001, 2.0, -rng.random() - 1e-9, 1.0 + rng.random() + 1e-9, None]
    extra = [-1, -rng.randrange(1, 1 << 62), 1.5, 3.0, rng.random() * 1e6 + 0.5, "7",
             2**63, 2**64 - 1]  # beyond int64: no real scheduler counts that high
    if WIRE_FORMS[form][2] is not None:
        extra += [2**64, 10**400]  # msgpack cannot even carry these
    if field != "data_parallel_rank":  # None there means "no DP" (rank 0) and is valid
        extra.append(None)
    return common + extra


def _lookalike_frames() -> list[bytes]:
    """Valid frames whose module path or class name is off by one character (same length, so the
    pickle's string lengths and framing stay valid)."""
    out: list[bytes] = []
    for form in PICKLE_FORMS:
        frame = encode_kv_metrics(form, **HOSTILE_BASE)
        module = WIRE_FORMS[form][0].encode()
        for i in (0, len(module) // 2, len(module) - 1):
            fake = module[:i] + (b"X" if module[i:i + 1] != b"X" else b"Y") + module[i + 1:]
            out.append(frame.replace(module, fake))
        for fake_name in (b"KvMetricz", b"kvMetrics", b"KvMetrics".upper()[:9], b"LoadStats"):
            out.append(frame.replace(b"KvMetrics", fake_name))
    return out


@dataclasses.dataclass
class _Foreign:
    x: int = 1


def build_corpus(tmp: Path, seed: int = SEED) -> list[tuple[str, str, Any]]:
    """[(category, expected refusal reason, frame bytes | list of parts)] — deterministic for a seed."""
    rng = random.Random(seed)
    c: list[tuple[str, str, Any]] = []

    def add(cat: str, reason: str, frames: list[Any], times: int = 1) -> None:
        c.extend((cat, reason, f) for _ in range(times) for f in frames)

    # random bytes that are neither pickle nor msgpack by their first byte
    not_ours = [b for b in range(256) if b != 0x80 and not (0x90 <= b <= 0x9F) and b not in (0xDC, 0xDD)]
    add("noise", "unknown_format",
        [bytes([rng.choice(not_ours)]) + rng.randbytes(rng.randrange(0, 400)) for _ in range(2500)])
    add("empty", "empty", [b""], times=50)
    # random pickle opcode streams: every opcode except STOP, those that name code or persistent
    # ids, and memo PUTs (see test_a_tiny_frame_cannot_make_the_actor_allocate_hundreds_of_mib)
    excluded = set(b".cio\x92\x93\x82\x83\x84PQpr")
    alphabet = bytes(b for b in range(256) if b not in excluded)
    add("pickle_noise", "bad_pickle",
        [b"\x80" + bytes([rng.choice((2, 3, 4, 5))]) + bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 200)))
         for _ in range(1500)])
    add("msgpack_noise", "bad_msgpack",
        [bytes([rng.choice([0x99, 0xDC, 0xDD, 0x90 + rng.randrange(16)])]) + rng.randbytes(rng.randrange(0, 200))
         for _ in range(500)])
    # every truncation of every wire form
    for form in WIRE_FORMS:
        frame = encode_kv_metrics(form, **HOSTILE_BASE)
        reason = "bad_msgpack" if WIRE_FORMS[form][2] is None else "bad_pickle"
        add("truncated", reason, [frame[:cut] for cut in range(1, len(frame))])
    # code execution attempts: every protocol, plain and hidden inside each form's KvMetrics state
    malicious: list[bytes] = []
    legacy: list[bytes] = []
    n = 0
    for proto in (2, 3, 4, 5):
        for _ in range(40):
            for payload in _file_creators(str(tmp / f"pwned-{n}")):
                malicious.append(pickle.dumps(payload, protocol=proto))
            n += 1
    for form in PICKLE_FORMS:
        for field in KV_METRICS_FIELDS:
            for payload in _file_creators(str(tmp / f"pwned-{n}")):
                shape, proto = WIRE_FORMS[form][1], WIRE_FORMS[form][2]
                if shape == "struct":
                    obj = kv_metrics_class(form)(**{**HOSTILE_BASE, field: payload})
                else:
                    obj = make_kv_metrics(form, **HOSTILE_BASE)
                    object.__setattr__(obj, field, payload)
                malicious.append(pickle.dumps(obj, protocol=proto))
            n += 1
    for proto in (0, 1):  # pre-protocol-2 pickles never start with PROTO: refused by their first byte
        for payload in _file_creators(str(tmp / f"pwned-{n}")):
            legacy.append(pickle.dumps(payload, protocol=proto))
        n += 1
    add("malicious", "forbidden_global", malicious)
    add("malicious_proto0_1", "unknown_format", legacy, times=10)
    # extension codes (EXT1/2/4) are opcodes SGLang never emits: refused before unpickling (they
    # are unregistered in the actor's process besides, and a registered one goes through find_class)
    add("ext_codes", "bad_pickle", _ext_code_pickles(str(tmp / "pwned-ext")), times=5)
    # other classes, and plain data that is not a KvMetrics
    foreign_classes = [collections.OrderedDict(a=1), decimal.Decimal("1.5"), uuid.UUID(int=7), ValueError("x"),
                       _Foreign(), complex(1, 2), range(3)]
    add("foreign_class", "forbidden_global",
        [pickle.dumps(o, protocol=p) for o in foreign_classes for p in (2, 3, 4, 5)] + _lookalike_frames(), times=4)
    data = [dict(HOSTILE_BASE), list(HOSTILE_BASE.values()), "KvMetrics", None, 7, 1.5, (1, 2), True,
            [dict(HOSTILE_BASE)], -(10**30)]
    add("foreign_data", "not_kv_metrics", [pickle.dumps(o, protocol=p) for o in data for p in (4, 5)], times=10)
    # opcodes SGLang's KvMetrics pickles never use: refused before the unpickler runs, even when
    # they would also name a forbidden class (datetime's state is BINBYTES)
    unused = [pickle.dumps(o, protocol=p) for o in (b"KvMetrics", {1, 2}, frozenset({3}), bytearray(b"x"),
                                                   datetime.datetime(2024, 1, 1)) for p in (4, 5)]
    for form in ("0.5.8", "0.5.12"):
        obj = make_kv_metrics(form, **HOSTILE_BASE)
        object.__setattr__(obj, "request_active_slots", b"\x01")
        unused.append(pickle.dumps(obj, protocol=4))
    unused.append(b"\x80\x04N" + b"r" + struct.pack("<I", 7) + b".")  # LONG_BINPUT, small index
    unused.append(b"\x80\x04N" + b"p7\n" + b".")  # PUT
    add("unused_opcode", "bad_pickle", unused, times=10)
    # values nested deep, or sharing sub-lists so that rendering them would explode
    add("nested_value", "invalid_value",
        [_splice("0.5.12", "request_active_slots", _nested_lists(20_000)),
         _splice("0.5.8", "kv_active_blocks", _doubling_lists(20))], times=5)
    # otherwise valid KvMetrics of every form with one wrong value
    invalid = [_invalid_value_frame(form, field, v)
               for form in WIRE_FORMS for field in KV_METRICS_FIELDS for v in _bad_values(field, form, rng)]
    add("invalid_value", "invalid_value", invalid, times=2)
    missing = []
    for form in ("0.4.9", "0.5.8", "0.5.10"):  # plain classes: a field never assigned
        for field in KV_METRICS_FIELDS[:-1]:
            obj = make_kv_metrics(form, **HOSTILE_BASE)
            delattr(obj, field)
            missing.append(pickle.dumps(obj, protocol=4))
    add("missing_field", "invalid_value", missing, times=5)
    extra = []
    for form in ("0.4.9", "0.5.8", "0.5.10", "0.5.12", "0.5.14"):
        obj = make_kv_metrics(form, **HOSTILE_BASE)
        obj.__dict__["surprise"] = 1
        extra.append(pickle.dumps(obj, protocol=4))
    add("extra_field", "unknown_field", extra, times=10)
    add("msgpack_shape", "bad_msgpack",
        [msgspec.msgpack.encode(x) for x in (["LoadStats", 1, 2, 3, 4, 5, 0.1, 0.2, 0], ["KvMetrics", 1, 2],
                                             ["KvMetrics"] + [0] * 9, [], [None] * 9)], times=10)
    # oversized, but below ZMQ's hard limit: refused unread (a valid KvMetrics + padding would decode)
    valid_head = encode_kv_metrics("0.5.8", **HOSTILE_BASE)
    sizes = [MAX_FRAME + 1, HARD_LIMIT] + [rng.randrange(MAX_FRAME + 1, HARD_LIMIT) for _ in range(118)]
    add("oversized", "oversized",
        [(valid_head + b"\x00" * (s - len(valid_head))) if i % 2 else rng.randbytes(s) for i, s in enumerate(sizes)])
    # multipart messages (SGLang never sends them), including ones made of valid frames
    good = encode_kv_metrics("0.5.23", **HOSTILE_BASE)
    parts_options = [[good, good], [good, b""], [b"", good], [malicious[0], good], [good] * 5, [b"a", b"b", b"c"]]
    add("multipart", MULTIPART, [parts_options[i % len(parts_options)] for i in range(240)])
    rng.shuffle(c)
    return c


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory):
    """One worker actor (attach mode: a HealthServer as its url) bound on an ipc:// PULL."""
    import ray

    from actors.aggregator.actor import get_or_create_aggregator
    from actors.fleet import WorkerSpec
    from actors.models import Settings
    from actors.worker.actor import start_worker

    tmp = tmp_path_factory.mktemp("hostile-frames")
    server = HealthServer()
    spec = WorkerSpec(name="hostile-w", url=server.url, metrics_endpoint=f"ipc://{tmp}/hostile.metrics")
    settings = Settings()
    agg = get_or_create_aggregator(settings)
    ray.get(agg.ping.remote())
    actor = start_worker(spec, settings, name_prefix="hostile-frames-")
    ray.get(actor.ready.remote(), timeout=30)
    yield {"actor": actor, "endpoint": spec.metrics_endpoint, "agg": agg, "name": spec.name, "tmp": tmp}
    ray.get(actor.stop.remote(), timeout=10)
    ray.kill(actor, no_restart=True)
    server.close()


def _identity(actor) -> tuple[int, str]:
    """(pid, incarnation) of the actor process: both change if the actor crashed and restarted."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: (os.getpid(), self.incarnation)), timeout=10)


def _stats(actor, timeout: float = 10) -> Any:  # a WorkerActorStats
    import ray

    return ray.get(actor.stats.remote(), timeout=timeout)


def _agg_metrics(agg, name: str) -> dict[str, Any] | None:
    import ray

    from actors.models import sum_ranks
    from actors.protocol import decode_delta

    snap = decode_delta(ray.get(agg.snapshot.remote(), timeout=10))
    for w in snap.workers:
        if w.name == name:
            return sum_ranks([r.values() for r in w.ranks])
    return None


def _push(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _valid_values(i: int) -> dict[str, Any]:
    """The i-th valid frame's values; kv_active_blocks = i identifies it."""
    return dict(request_active_slots=i % 64, request_total_slots=64, kv_active_blocks=i, kv_total_blocks=10_000_000,
                num_requests_waiting=i % 7, gpu_cache_usage_perc=(i % 1000) / 1000,
                gpu_prefix_cache_hit_rate=(i % 100) / 100, data_parallel_rank=0)


class _ValidEmitter(threading.Thread):
    """Sends valid frames (all seven wire forms in turn) every `period_s` until stopped."""

    def __init__(self, endpoint: str, period_s: float = 0.002, start_at: int = 1) -> None:
        super().__init__(daemon=True)
        forms = sorted(WIRE_FORMS)
        # pre-encoded: sim.sglang_shapes re-points shared module paths per form, not thread-safe
        self.frames = [encode_kv_metrics(forms[i % len(forms)], **_valid_values(i))
                       for i in range(start_at, start_at + 20_000)]
        self.start_at = start_at
        self.endpoint, self.period_s = endpoint, period_s
        self.sent_at: list[float] = []
        self.stop_evt = threading.Event()

    @property
    def sent(self) -> int:
        return len(self.sent_at)

    @property
    def last_value(self) -> int:
        return self.start_at + self.sent - 1

    def run(self) -> None:
        sock = _push(self.endpoint)
        try:
            nxt = time.monotonic()
            for frame in self.frames:
                if self.stop_evt.is_set():
                    break
                sock.send(frame)
                self.sent_at.append(time.monotonic())
                nxt += self.period_s
                delay = nxt - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        finally:
            sock.close(linger=0)

    def staleness_s(self, observed: int, now: float) -> float:
        """How long ago a value newer than `observed` was sent (0 if `observed` is the newest)."""
        k = observed - self.start_at + 1  # index of the first value newer than `observed`
        return 0.0 if k >= len(self.sent_at) else now - self.sent_at[k]


# --- the fuzz run ------------------------------------------------------------------------------


def test_more_than_30000_hostile_frames_crash_nothing_run_nothing_and_are_counted_exactly(live, tmp_path):
    actor, agg, name = live["actor"], live["agg"], live["name"]
    corpus = build_corpus(tmp_path) * ROUNDS  # the same hostile mix, over and over, at full speed
    assert len(corpus) >= 30_000
    expected = Counter(reason for _, reason, _ in corpus)
    identity = _identity(actor)
    before = _stats(actor)

    valid = _ValidEmitter(live["endpoint"])
    valid.start()
    time.sleep(0.3)  # the valid stream is flowing before the first hostile frame
    stale: dict[str, float] = {"actor": 0.0, "aggregator": 0.0}
    done = threading.Event()

    def hostile() -> None:
        sock = _push(live["endpoint"])
        try:
            for _, reason, frame in corpus:
                sock.send_multipart(frame) if reason == MULTIPART else sock.send(frame)
        finally:
            done.wait(30)
            sock.close(linger=0)

    sender = threading.Thread(target=hostile, daemon=True)
    t0 = time.monotonic()
    sender.start()
    samples = 0
    # while the hostile frames pour in, the valid stream's value must stay fresh in the actor and
    # in the aggregator
    while (time.monotonic() - t0 < 30 and
           _stats(actor).frames_received - before.frames_received < len(corpus) + valid.sent):
        now = time.monotonic()
        s = _stats(actor)
        if s.latest:
            stale["actor"] = max(stale["actor"], valid.staleness_s(s.latest[0]["kv_active_blocks"], now))
        m = _agg_metrics(agg, name)
        if m:
            stale["aggregator"] = max(stale["aggregator"], valid.staleness_s(m["kv_active_blocks"], time.monotonic()))
        samples += 1
        time.sleep(0.02)
    time.sleep(0.3)  # a little more valid traffic after the hostile burst
    valid.stop_evt.set()
    valid.join(5)
    done.set()
    sender.join(10)
    last = valid.last_value
    wait_for(lambda: _stats(actor).frames_received - before.frames_received == len(corpus) + valid.sent, 20,
             what=f"all {len(corpus)} hostile + {valid.sent} valid messages received")
    elapsed = time.monotonic() - t0
    after = _stats(actor)

    # 0 crashes: same process, same incarnation, and the counters were never reset
    assert _identity(actor) == identity
    # 0 executions: none of the payloads created its file
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # every refusal counted under its reason, exactly
    got = Counter(after.refused_by_reason) - Counter(before.refused_by_reason)
    assert dict(got) == dict(expected), {k: (got[k], expected[k]) for k in set(got) | set(expected) if got[k] != expected[k]}
    assert after.frames_refused - before.frames_refused == len(corpus)
    # exactly the valid frames were accepted, and the latest value is the last one sent, exactly
    assert after.frames_accepted - before.frames_accepted == valid.sent
    assert valid.sent >= 200, f"the valid emitter only sent {valid.sent} frames"
    assert after.latest[0] == _valid_values(last)
    # the aggregator has it too, promptly (kv blocks: page_size 1 → tokens)
    t_last = valid.sent_at[-1]
    m = wait_for(lambda: (x := _agg_metrics(agg, name)) and x["kv_active_blocks"] == last and x, 2,
                 interval_s=0.005, what="last valid value in the aggregator")
    assert time.monotonic() - t_last < 2.5
    assert {k: m[k] for k in KV_METRICS_FIELDS} == _valid_values(last)
    # fresh all along: no valid value went unseen for long while the hostile frames poured in
    assert samples >= 3
    assert stale["actor"] < 0.5, f"actor lagged {stale['actor']:.3f} s behind the valid stream"
    assert stale["aggregator"] < 1.0, f"aggregator lagged {stale['aggregator']:.3f} s behind the valid stream"
    assert elapsed < 45
    print(f"\n{len(corpus)} hostile + {valid.sent} valid in {elapsed:.1f} s, {samples} samples; max staleness actor "
          f"{stale['actor'] * 1000:.0f} ms, aggregator {stale['aggregator'] * 1000:.0f} ms; {dict(expected)}")


def test_the_malicious_payloads_are_live_under_a_plain_unpickler(tmp_path):
    """Control for the fuzz run: the same payloads DO create their files under `pickle.loads`
    (in a throwaway process), so "no file created" above means "nothing executed"."""
    n = len(_file_creators("x"))
    creators = {tmp_path / f"live-{i}": pickle.dumps(_file_creators(str(tmp_path / f"live-{i}"))[i], protocol=4)
                for i in range(n)}
    code = (
        "import pickle, sys, time\n"
        "for f in sys.stdin.buffer.read().split(b'\\0SPLIT\\0'):\n"
        "    try: pickle.loads(f)\n"
        "    except Exception: pass\n"
        "time.sleep(0.5)\n"  # Popen children finish touching
    )
    subprocess.run([sys.executable, "-c", code], input=b"\0SPLIT\0".join(creators.values()), timeout=30, check=True)
    created = [t for t in creators if t.exists()]
    # all but the copyreg gadget (which only builds an object) touch their file
    assert len(created) == len(creators) - 1, sorted(p.name for p in created)


# --- oversized beyond ZMQ's hard limit -------------------------------------------------------------


def test_a_frame_above_the_1_mib_hard_limit_drops_only_its_sender(live):
    """Above 16 × max_frame_bytes ZMQ disconnects the sending peer before the actor sees a byte:
    the actor is not hurt, the frame is not counted, and other emitters carry on."""
    actor = live["actor"]
    identity = _identity(actor)
    other = _ValidEmitter(live["endpoint"], period_s=0.005, start_at=1_000_000)
    giant = _push(live["endpoint"])
    try:
        other.start()
        wait_for(lambda: (s := _stats(actor)).latest and s.latest[0]["kv_active_blocks"] >= 1_000_000, 5,
                 what="the other emitter's frames")
        before = _stats(actor)
        for size in (HARD_LIMIT + 1, 4 * HARD_LIMIT, 32 * HARD_LIMIT):  # 1 MiB + 1 B, 4 MiB, 32 MiB
            giant.send(b"\x80" + b"\x00" * (size - 1))
        mark = other.last_value
        wait_for(lambda: _stats(actor).latest[0]["kv_active_blocks"] > mark + 50, 5,
                 what="the other emitter still getting through")
        other.stop_evt.set()
        other.join(5)
        final = other.last_value
        after = wait_for(lambda: (s := _stats(actor)).latest[0]["kv_active_blocks"] == final and s, 5,
                         what="the other emitter's last value")
    finally:
        other.stop_evt.set()
        giant.close(linger=0)
    assert _identity(actor) == identity
    # the giants never reached the application: nothing refused, every counted frame was valid
    assert after.frames_refused == before.frames_refused
    assert after.frames_received - before.frames_received == after.frames_accepted - before.frames_accepted


def test_a_frame_of_exactly_max_frame_bytes_is_read_and_one_byte_more_is_not(live):
    actor = live["actor"]
    head = encode_kv_metrics("0.5.8", **_valid_values(5_000_000))
    sock = _push(live["endpoint"])
    try:
        before = _stats(actor)
        sock.send(head + b"\x00" * (MAX_FRAME - len(head)))  # trailing bytes after STOP are ignored
        sock.send(encode_kv_metrics("0.5.8", **_valid_values(5_000_001)) + b"\x00" * (MAX_FRAME + 1 - len(head)))
        after = wait_for(lambda: (s := _stats(actor)).frames_received - before.frames_received == 2 and s, 5,
                         what="both frames received")
    finally:
        sock.close(linger=0)
    assert after.frames_accepted - before.frames_accepted == 1
    assert after.refused_by_reason["oversized"] - before.refused_by_reason.get("oversized", 0) == 1
    assert after.latest[0]["kv_active_blocks"] == 5_000_000


# --- frames that would cost far more than their size -----------------------------------------

_SPLICE = "@@kvroute-splice@@"


def _splice(form: str, field: str, make_ops) -> bytes:
    """A valid protocol-4 KvMetrics pickle of `form` whose `field` value is replaced by the raw
    opcodes `make_ops(memo_index)` (which must leave one object on the stack). Framing is dropped
    (it is optional), so the opcodes may have any length."""
    raw = pickle.dumps(make_kv_metrics(form, **{**HOSTILE_BASE, field: _SPLICE}), protocol=4)
    ops = list(pickletools.genops(raw))
    assert ops[1][0].name == "FRAME"
    memo = 0
    for op, arg, _ in ops:
        if op.name == "SHORT_BINUNICODE" and arg == _SPLICE:
            break
        memo += op.name == "MEMOIZE"
    needle = b"\x8c" + bytes([len(_SPLICE)]) + _SPLICE.encode() + b"\x94"
    body = raw[ops[2][2]:]
    assert body.count(needle) == 1
    return b"\x80\x04" + body.replace(needle, make_ops(memo) + b"\x94")


def _nested_lists(depth: int):
    """[[[…]]] `depth` deep: EMPTY_LIST × depth, then APPEND × (depth - 1)."""
    return lambda memo: b"]" * depth + b"a" * (depth - 1)


def _doubling_lists(levels: int):
    """x0 = 0, x(k+1) = [xk, xk] through the memo: 30 bytes per level, 2**levels leaves."""
    def ops(memo: int) -> bytes:
        out = b"K\x00"
        for k in range(levels):
            ref = b"j" + struct.pack("<I", memo + k)  # LONG_BINGET
            out += b"\x94" + b"0" + b"]" + b"(" + ref + ref + b"e"  # MEMOIZE POP EMPTY_LIST MARK GET GET APPENDS
        return out
    return ops


def _send_and_count(live, frame: bytes, timeout: float = 60) -> tuple[dict, dict, float]:
    """Send one frame; return (stats before, stats once it is received, seconds until then)."""
    actor = live["actor"]
    before = _stats(actor)
    sock = _push(live["endpoint"])
    try:
        t0 = time.monotonic()
        sock.send(frame)
        after = wait_for(lambda: (s := _stats(actor, timeout=timeout)).frames_received > before.frames_received and s,
                         timeout, what="the frame received")
        return before, after, time.monotonic() - t0
    finally:
        sock.close(linger=0)


def test_a_deeply_nested_value_is_refused_as_invalid_value(live):
    """A list nested 20,000 deep (40 KB): refused and counted like any bad value — rendering it
    for the refusal message must not recurse (it once escaped as RecursionError, uncounted)."""
    frame = _splice("0.5.12", "request_active_slots", _nested_lists(20_000))
    assert len(frame) < MAX_FRAME
    before, after, _ = _send_and_count(live, frame)
    assert after.frames_refused - before.frames_refused == 1
    assert after.refused_by_reason.get("invalid_value", 0) - before.refused_by_reason.get("invalid_value", 0) == 1


def test_a_sub_kilobyte_frame_cannot_stall_the_actor(live):
    """23 levels of [x, x] through the memo: 635 bytes that stand for 2**23 elements. Refusing it
    must not walk them (a repr did: ~3 s of the actor's event loop, ×4 per 2 more levels)."""
    frame = _splice("0.5.12", "num_requests_waiting", _doubling_lists(23))
    assert len(frame) < 1024
    before, after, seconds = _send_and_count(live, frame)
    assert after.refused_by_reason.get("invalid_value", 0) - before.refused_by_reason.get("invalid_value", 0) == 1
    assert seconds < 0.5, f"one {len(frame)}-byte frame kept the actor busy for {seconds:.1f} s"


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_tiny_frame_cannot_make_the_actor_allocate_hundreds_of_mib(live):
    """LONG_BINPUT with index 2**25: the C unpickler would size (and zero) its memo from it —
    512 MiB for a 9-byte frame. The actor's peak RSS must not move."""
    pid, _ = _identity(live["actor"])
    frame = b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 25) + b"."  # None, LONG_BINPUT 2**25, STOP
    peak_before = _peak_rss_mib(pid)
    before, after, _ = _send_and_count(live, frame)
    grown = _peak_rss_mib(pid) - peak_before
    assert after.frames_refused - before.frames_refused == 1
    assert grown < 64, f"a {len(frame)}-byte frame raised the actor's peak RSS by {grown:.0f} MiB"


@pytest.fixture(scope="module")
def router(live, serve_port, tmp_path_factory):
    """The router (Ray Serve HTTP) over the hostile worker and one clean worker."""
    import httpx
    import ray
    from ray import serve

    from actors.fleet import parse_fleet
    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("hostile-frames-router")
    server = HealthServer()
    actor_spec = ray.get(live["actor"].ready.remote())
    fleet = parse_fleet({"workers": [
        {"name": live["name"], "url": actor_spec.url, "metrics_endpoint": live["endpoint"]},
        {"name": "hostile-clean", "url": server.url, "metrics_endpoint": f"ipc://{tmp}/clean.metrics"},
    ]})
    clean = start_worker(fleet.workers[1], fleet.settings, name_prefix="hostile-frames-")
    ray.get(clean.ready.remote(), timeout=30)
    emit = _push(fleet.workers[1].metrics_endpoint)
    emit.send(encode_kv_metrics("0.5.23", **_valid_values(10)))
    hostile_worker = _push(live["endpoint"])
    hostile_worker.send(encode_kv_metrics("0.5.23", **_valid_values(12)))
    hostile_worker.close(linger=100)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "router": {"policy": "least_loaded"}}),
              name="hostile-frames", route_prefix="/hostile-frames")
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}/hostile-frames", timeout=10)
    names = {live["name"], "hostile-clean"}
    wait_for(lambda: {w["name"] for w in client.get("/workers").json()["workers"] if w["metrics"]} >= names, 30,
             what="both workers with metrics in /workers")
    yield {"client": client, "emit_clean": emit}
    client.close()
    serve.delete("hostile-frames")
    emit.close(linger=0)
    ray.get(clean.stop.remote(), timeout=10)
    ray.kill(clean, no_restart=True)
    server.close()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 8}


def test_a_count_too_large_for_a_float_is_refused_and_routing_keeps_working(live, router):
    """num_requests_waiting = 10**400 in an otherwise valid 503-byte frame: refused as invalid_value
    (counts are int64 at most), so routing, /workers and /metrics never see it (accepted, it once
    made /route and /metrics answer 500 until the worker reported again)."""
    c = router["client"]
    poison = encode_kv_metrics("0.5.23", **{**_valid_values(20), "num_requests_waiting": 10**400})
    assert len(poison) < 600
    busy = {**_valid_values(20), "request_active_slots": 64, "num_requests_waiting": 50, "kv_active_blocks": 9_000_000}
    router["emit_clean"].send(encode_kv_metrics("0.5.23", **_valid_values(11)))  # lightly loaded
    try:
        _send_and_count(live, encode_kv_metrics("0.5.23", **busy))
        before, after, _ = _send_and_count(live, poison)
        time.sleep(0.5)  # ≫ push interval + long-poll hop: the router has it if it was accepted
        picks = {p: c.post("/route", json=CHAT, headers={"x-kvroute-policy": p}) for p in ("least_loaded", "kv_aware")}
        statuses = {
            **{f"route {p}": (r.status_code, r.json().get("worker")) for p, r in picks.items()},
            "workers": c.get("/workers").status_code,
            "metrics": c.get("/metrics").status_code,
            "refused as invalid_value": after.refused_by_reason.get("invalid_value", 0)
            - before.refused_by_reason.get("invalid_value", 0) == 1,
        }
        assert statuses == {"route least_loaded": (200, "hostile-clean"), "route kv_aware": (200, "hostile-clean"),
                            "workers": 200, "metrics": 200, "refused as invalid_value": True}
        assert _stats(live["actor"]).latest[0]["num_requests_waiting"] == 50
    finally:  # leave the worker with a sane value for the tests after this one
        sock = _push(live["endpoint"])
        sock.send(encode_kv_metrics("0.5.23", **_valid_values(21)))
        sock.close(linger=100)
        wait_for(lambda: _stats(live["actor"]).latest[0]["kv_active_blocks"] == 21, 5, what="reset value")


# --- who can reach the PULL at all ---------------------------------------------------------------


@pytest.mark.parametrize("host", ["0", "0.0", "0x0", "000.000.000.000", "[::]", "[0:0::0]"])
def test_every_spelling_of_the_unspecified_address_is_refused_as_a_metrics_endpoint(host):
    """ZMQ binds each of these on every interface (measured: LISTEN 0.0.0.0), exposing the
    pickle-decoding PULL to the network: the fleet validator must see through the spelling."""
    from actors.fleet import FleetError, parse_fleet

    with pytest.raises(FleetError, match="wildcard"):
        parse_fleet({"workers": [{"name": "w", "url": "http://127.0.0.1:30001", "metrics_endpoint": f"tcp://{host}:45555"}]})


def test_the_spelled_out_wildcards_are_refused_as_metrics_endpoints():
    from actors.fleet import FleetError, parse_fleet

    for host in ("*", "0.0.0.0"):
        with pytest.raises(FleetError, match="wildcard"):
            parse_fleet({"workers": [{"name": "w", "url": "http://127.0.0.1:30001",
                                      "metrics_endpoint": f"tcp://{host}:45555"}]})
