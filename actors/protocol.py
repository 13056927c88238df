"""Every message between kvroute's processes, as msgspec Structs: what worker actors and router
replicas push to the aggregator, the fleet deltas it publishes to router replicas, the KV-log
answers a worker actor gives router replicas, and what the actors' lifecycle calls return.

Every frame that crosses a socket is msgpack, encoded and decoded here with msgspec's typed
decoders: a frame that is not exactly one of these messages (wrong type, unknown field, negative
count, too large) raises `ProtocolError`, and nothing in a frame is ever executed (no pickle).

Wire forms: Structs are `array_like` (positional arrays: a fleet delta of 100 workers is a few KB,
not tens), and the ingest messages are tagged so one socket carries both kinds.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

import msgspec

from actors.wire.kv_events import KvEvent
from actors.models import KV_METRICS_FIELDS

assert KV_METRICS_FIELDS == (
    "request_active_slots", "request_total_slots", "kv_active_blocks", "kv_total_blocks", "num_requests_waiting",
    "gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate", "data_parallel_rank",
), "RankMetrics and its values() follow SGLang's KvMetrics fields"

Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]

MAX_INGEST_FRAME_BYTES = 1 << 20  # a report is ~150 B; a batch of reports stays far below
MAX_DELTA_FRAME_BYTES = 64 << 20  # a full snapshot of 10,000 workers is ~2 MB


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol (or carries the wrong token)."""


class RankMetrics(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One DP rank's latest SGLang KvMetrics, KV counts in blocks of the worker's page size, with
    its age when the report left the worker actor and the actor's change sequence number."""

    request_active_slots: Count
    request_total_slots: Count
    kv_active_blocks: Count
    kv_total_blocks: Count
    num_requests_waiting: Count
    gpu_cache_usage_perc: Fraction
    gpu_prefix_cache_hit_rate: Fraction
    data_parallel_rank: Count
    age_s: Seconds = 0.0
    seq: Count = 0

    def values(self) -> dict[str, Any]:
        """The eight SGLang fields as a dict (what router code and /workers show)."""
        return {  # spelled out: a follower calls this for every rank of every update (3× the comprehension)
            "request_active_slots": self.request_active_slots,
            "request_total_slots": self.request_total_slots,
            "kv_active_blocks": self.kv_active_blocks,
            "kv_total_blocks": self.kv_total_blocks,
            "num_requests_waiting": self.num_requests_waiting,
            "gpu_cache_usage_perc": self.gpu_cache_usage_perc,
            "gpu_prefix_cache_hit_rate": self.gpu_prefix_cache_hit_rate,
            "data_parallel_rank": self.data_parallel_rank,
        }


ShortText = Annotated[str, msgspec.Meta(max_length=4096)]


class ManagedEngine(msgspec.Struct, array_like=True, frozen=True):
    """The engine process a worker actor manages (managed mode only)."""

    process: Annotated[str, msgspec.Meta(max_length=32)]  # starting | running | restarting | failed | stopped
    pid: Count | None = None
    restarts: Count = 0
    last_exit: int | None = None
    detail: ShortText = ""


class KvHandshakeSide(msgspec.Struct, array_like=True, frozen=True):
    """How one DP rank's KV-event stream is met: which side kvroute takes (bind | connect), where."""

    rank: Count
    kvroute: Annotated[str, msgspec.Meta(max_length=16)]
    address: Annotated[str, msgspec.Meta(max_length=1024)]


class KvEventsStatus(msgspec.Struct, array_like=True, frozen=True):
    """A worker actor's KV-event subscription (exact prefix mode), as /workers shows it."""

    status: Annotated[str, msgspec.Meta(max_length=16)]  # waiting | ok | silent
    handshake: Annotated[list[KvHandshakeSide], msgspec.Meta(max_length=1024)]
    batches: Count
    detail: ShortText = ""  # why the subscription is silent (only when it is)


class Adapter(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter a worker has loaded, as its /v1/models lists it (`id`, `root`, with `parent`)."""

    name: Name
    path: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class WorkerReport(msgspec.Struct, array_like=True, frozen=True):
    """What a worker actor knows about its worker: registration, liveness and latest ranks.
    Every report is whole (no deltas), so a restarted aggregator is rebuilt by the next ones."""

    name: Name
    url: str
    page_size: Annotated[int, msgspec.Meta(ge=1)]
    incarnation: str
    healthy: bool
    health_detail: str = ""
    ranks: list[RankMetrics] = []
    managed: ManagedEngine | None = None
    kv_events_actor: Name | None = None  # the Ray actor (in NAMESPACE) whose `kv_since` routers follow
    kv_events: KvEventsStatus | None = None
    models: Annotated[list[Name], msgspec.Meta(max_length=64)] = []  # the model names it serves ([] = unknown)
    role: Literal["prefill", "decode", "both"] = "both"  # PD disaggregation role (docs/pd.md)
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None  # role prefill: its bootstrap port
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1  # attention-DP ranks (the fleet entry's dp_size)
    # the LoRA adapters it has loaded: its /v1/models entries with a `parent` (SGLang's form), by name
    adapters: Annotated[list[Adapter], msgspec.Meta(max_length=1024)] = []


class ReportBatch(msgspec.Struct, tag="r", array_like=True, frozen=True):
    """Reports pushed in one frame (a worker actor sends its own; a relay may send many)."""

    token: str
    reports: list[WorkerReport]


class InFlightShare(msgspec.Struct, tag="f", array_like=True, frozen=True):
    """A router replica's in-flight requests per worker, shared so replicas do not herd."""

    token: str
    replica: Name
    counts: dict[str, Count]


Ingest = Union[ReportBatch, InFlightShare]


class WorkerUpdate(msgspec.Struct, array_like=True, frozen=True):
    """One worker as the aggregator sees it now (states derived, ages at publication)."""

    name: str
    url: str
    page_size: int
    state: str  # live | idle | down
    healthy: bool
    health_detail: str
    metrics_age_s: float | None
    heartbeat_age_s: float
    ranks: list[RankMetrics]
    in_flight_by_replica: dict[str, int]
    version: int
    managed: ManagedEngine | None = None
    kv_events_actor: str | None = None
    kv_events: KvEventsStatus | None = None
    models: list[str] = []  # the model names it serves ([] = unknown)
    role: str = "both"  # PD disaggregation role: prefill | decode | both
    bootstrap_port: int | None = None  # role prefill: its --disaggregation-bootstrap-port
    dp_size: int = 1  # attention-DP ranks: each is a routing target of its own when > 1
    adapters: list[Adapter] = []  # the LoRA adapters it has loaded


class MetricsUpdate(msgspec.Struct, array_like=True, frozen=True):
    """A worker whose new ranks are all that changed (the common case under load: registration,
    state and in-flight counts as the follower already has them) — a third of a `WorkerUpdate`."""

    name: str
    metrics_age_s: float
    ranks: list[RankMetrics]
    version: int


class FleetDelta(msgspec.Struct, array_like=True, frozen=True):
    """Workers changed in (`prev_version`, `version`] of registry `epoch`: whole records in
    `workers`, those whose ranks alone changed in `metrics` (never both). `names` is the whole
    membership, sent only when it changed in that range (and in every full snapshot). A follower
    at version v applies a delta iff same epoch and `prev_version <= v < version`; a delta with
    `prev_version > v` means it missed one and must resync from a full snapshot. `replicas`: the
    router replicas whose in-flight shares are current (`InFlightShare`), sent like `names` — when
    it changed in that range, and in every full snapshot; a replica alone in it need not share fast.
    `heard`: workers whose report arrived since the previous delta without changing anything (a
    heartbeat), so followers know their heartbeat age without a version per heartbeat."""

    epoch: str
    version: int
    prev_version: int
    full: bool
    workers: list[WorkerUpdate]
    names: list[str] | None = None
    metrics: list[MetricsUpdate] = []
    replicas: list[str] | None = None
    heard: list[str] = []


class Endpoints(msgspec.Struct, frozen=True):
    """Where the aggregator listens (handed out through Ray, never guessed): its PULL for
    reports, its PUB of deltas, and the token every pushed frame must carry."""

    epoch: str
    ingest: str
    publish: str
    token: str


class KvLogEntry(msgspec.Struct, array_like=True, frozen=True):
    """One batch of a rank's KV events, numbered in the worker actor's log."""

    seq: int
    rank: int
    events: tuple[KvEvent, ...]


class KvLogAnswer(msgspec.Struct, frozen=True):
    """`WorkerActor.kv_since`'s answer: the entries after the asker's cursor, or (`full`) the whole
    current state when the cursor is from another epoch or older than the retained log."""

    epoch: str
    seq: int
    full: bool
    entries: list[KvLogEntry]


class WorkerReady(msgspec.Struct, frozen=True):
    """`WorkerActor.ready()`: where the worker is (managed mode: once its engine answers /health)."""

    name: str
    url: str
    metrics_endpoint: str
    node_id: str | None
    managed: ManagedEngine | None


class KvEventsCounters(msgspec.Struct, frozen=True):
    """A worker actor's KV-event subscription as `stats()` shows it: its log and what it received."""

    seq: int  # the actor's KV log position
    blocks: int  # blocks the log holds for rank 0
    refused: dict[str, int]  # batches refused, by reason
    gaps: int  # sequence gaps seen (each replayed or its rank dropped)
    replayed: int  # batches recovered from the engine's replay buffer
    endpoint: str | None
    subscription: KvEventsStatus


class WorkerActorStats(msgspec.Struct, frozen=True):
    """`WorkerActor.stats()`: what its receive path took and refused, what it pushed, its health."""

    name: str
    frames_received: int
    frames_accepted: int
    frames_refused: int
    refused_by_reason: dict[str, int]
    pushes: int
    pushes_dropped: int  # the aggregator was away or slow; newer state went instead
    aggregator_connects: int
    healthy: bool
    health_detail: str
    aggregator_epoch: str | None
    last_refusal: str | None
    latest: dict[int, dict[str, Any]]  # DP rank → its newest SGLang KvMetrics (token counts, as received)
    kv_events: KvEventsCounters | None


class AggregatorStats(msgspec.Struct, frozen=True):
    """`Aggregator.stats()`: counters for benchmarks and diagnosis."""

    pid: int
    epoch: str
    workers: int
    version: int
    reports: int
    in_flight_shares: int
    refused: dict[str, int]
    published: int
    published_bytes: int
    endpoints: dict[str, tuple[str, str]]
    late_reports: int = 0  # reports of a removed worker's incarnation that arrived after its removal (ignored)


_ingest_encoder = msgspec.msgpack.Encoder()
_ingest_decoder = msgspec.msgpack.Decoder(Ingest)
_delta_encoder = msgspec.msgpack.Encoder()
_delta_decoder = msgspec.msgpack.Decoder(FleetDelta)


def encode(msg: ReportBatch | InFlightShare | FleetDelta) -> bytes:
    return _ingest_encoder.encode(msg)


def decode_ingest(frame: bytes, max_bytes: int = MAX_INGEST_FRAME_BYTES) -> ReportBatch | InFlightShare:
    """One pushed frame → its message. Raises ProtocolError for anything else."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        msg = _ingest_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)[:200]) from None
    if isinstance(msg, ReportBatch):
        for r in msg.reports:
            for rank in r.ranks:
                if not (math.isfinite(rank.gpu_cache_usage_perc) and math.isfinite(rank.gpu_prefix_cache_hit_rate)
                        and math.isfinite(rank.age_s)):
                    raise ProtocolError(f"worker {r.name}: non-finite value")
    return msg


def encode_delta(delta: FleetDelta) -> bytes:
    return _delta_encoder.encode(delta)


def decode_delta(frame: bytes) -> FleetDelta:
    """A published or snapshot frame → FleetDelta. Raises ProtocolError for anything else."""
    if len(frame) > MAX_DELTA_FRAME_BYTES:
        raise ProtocolError(f"delta of {len(frame)} bytes exceeds {MAX_DELTA_FRAME_BYTES}")
    try:
        return _delta_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)[:200]) from None
