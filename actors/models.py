"""Typed messages and settings of the metrics plane: KvMetrics, its thresholds, worker states, the Ray namespace."""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# SGLang's eight KvMetrics field names, in the order of the msgpack tagged array (0.5.16+).
KV_METRICS_FIELDS: tuple[str, ...] = (
    "request_active_slots",
    "request_total_slots",
    "kv_active_blocks",
    "kv_total_blocks",
    "num_requests_waiting",
    "gpu_cache_usage_perc",
    "gpu_prefix_cache_hit_rate",
    "data_parallel_rank",
)

# The Ray namespace of every named kvroute actor (aggregator, worker actors) and of the drivers
# that look them up (`kvroute serve|down`, router replicas). Defined once, here: `actors/` is the
# lowest layer, so every other package can import it.
NAMESPACE = "kvroute"

INT64_MAX = 2**63 - 1  # SGLang's counts are C/torch int64s; anything larger is not a real report
Count = Annotated[int, Field(ge=0, le=INT64_MAX, strict=True)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, strict=True, allow_inf_nan=False)]


class KvMetrics(BaseModel):
    """One scheduler report, exactly SGLang's fields. `kv_*_blocks` are in **tokens** on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_active_slots: Count
    request_total_slots: Count
    kv_active_blocks: Count
    kv_total_blocks: Count
    num_requests_waiting: Count
    gpu_cache_usage_perc: Fraction
    gpu_prefix_cache_hit_rate: Fraction
    data_parallel_rank: Count = 0


def tokens_to_blocks(tokens: int, page_size: int) -> int:
    """Token count → pages of `page_size` (ceil), as the engine allocates them."""
    return -(-tokens // page_size)


class WorkerState(str, enum.Enum):
    """Routing state of a worker, derived by the aggregator (see `derive_state`)."""

    LIVE = "live"  # healthy and its metrics are fresh
    IDLE = "idle"  # healthy, silent for `idle_after_s`: its last report is not load any more
    DOWN = "down"  # heartbeat lost or health failing: never routed to


class Settings(BaseModel):
    """The metrics plane's thresholds and intervals: worker actors, the aggregator, and the
    followers that carry its snapshot to router replicas. The fleet file's `settings:` section.

    The router's own knobs (policy, ledger, prefix index, breaker, upstream) are in
    `serve_app.config.RouterConfig`; `serve_app.config.KvrouteConfig` is the whole tree.
    """

    model_config = ConfigDict(extra="forbid")

    # worker actor
    engine_start_timeout_s: float = Field(
        600.0, gt=0, description="managed mode: how long a worker's engine may take to answer /health 200 after it "
        "starts (SGLang loads the model and captures graphs first: minutes for a large model) before the worker "
        "fails with a clear error"
    )
    push_interval_s: float = Field(0.010, gt=0, description="min gap between metric pushes")
    heartbeat_s: float = Field(0.5, gt=0, description="liveness push period")
    health_interval_s: float = Field(
        1.0, gt=0, description="liveness probe period (GET /v1/models: cheap on SGLang, and it keeps the worker's "
        "model and LoRA-adapter list fresh) of a worker whose KvMetrics frames are silent (idle, or gone) or whose "
        "last probe failed; a dead worker is probed, so down, at most this long after its last frame"
    )
    health_busy_interval_s: float = Field(
        5.0, gt=0, description="passive liveness: while a worker's KvMetrics frames keep arriving (one within "
        "health_interval_s), its scheduler is alive and the liveness probe runs only this often — it catches an "
        "HTTP server that hangs while the scheduler still publishes"
    )
    health_timeout_s: float = Field(1.0, gt=0, description="liveness probe (GET /v1/models) timeout")
    health_check_interval_s: float = Field(
        10.0, gt=0, description="period of the slow confirmation, GET /health: on SGLang it runs a one-token "
        "generation through the scheduler and answers after at least 1 s (200), or 503 after its own "
        "SGLANG_HEALTH_CHECK_TIMEOUT (20 s) — a 503 marks the worker down"
    )
    health_check_timeout_s: float = Field(
        25.0, gt=0, description="GET /health timeout: longer than SGLang's own 20 s verdict, so that its 503 is "
        "what kvroute sees; a timeout counts as one probe timeout"
    )
    health_timeouts_before_down: int = Field(
        2, ge=1, description="consecutive probe timeouts before unhealthy (refused = at once)"
    )
    max_frame_bytes: int = Field(64 * 1024, gt=0, description="larger frames are refused unparsed")
    max_pending_pushes: int = Field(
        2, ge=1, description="reports queued toward the aggregator before newer ones are dropped (ZMQ send HWM)"
    )
    kv_events_silence_s: float = Field(
        5.0, gt=0, description="KvMetrics show held KV pages this long with no KV-event batch → 'silent'"
    )
    kv_events_replay_timeout_s: float = Field(2.0, gt=0, description="wait for a replay ROUTER's answer")
    # aggregator
    idle_after_s: float = Field(3.0, gt=0, description="silence after which a healthy worker is idle")
    down_after_s: float = Field(2.0, gt=0, description="heartbeat age after which a worker is down")
    state_tick_s: float = Field(0.1, gt=0, description="how often time-driven states are re-derived")
    publish_interval_s: float = Field(
        0.01, gt=0, description="the aggregator's coalescing window: it drains pushed reports and publishes one "
        "delta to router replicas at most this often"
    )
    coalesce_s: float = Field(
        0.1, gt=0, description="how long a change may wait for others where the plane is lightly loaded, to save "
        "wake-ups: a worker actor pushes a busy engine's metrics at most once per window (the first change after a "
        "quiet spell at once), and the aggregator publishes deltas of fewer than 8 workers at most once per window "
        "(larger ones every publish_interval_s). 0.1 s: on the Mooncake replay kv_aware routes as well as at 0.05 "
        "(its own ledger carries what it sent since) for half the wake-ups (bench/results/scale.md)"
    )
    aggregator_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources the aggregator requests (e.g. kvroute_head)"
    )
    # followers (the aggregator → router replica long-poll) and every link to the aggregator
    snapshot_poll_timeout_s: float = Field(
        5.0, gt=0, description="Ray-call timeout of a follower's full snapshot (start and resync)"
    )
    follower_silence_s: float = Field(
        1.5, gt=0, description="no delta or keep-alive this long → the follower re-resolves the aggregator"
    )
    reconnect_backoff_s: float = Field(
        0.1, gt=0, description="first retry delay to the aggregator (worker actors' links, router followers)"
    )
    reconnect_backoff_max_s: float = Field(0.5, gt=0, description="cap of that delay")


def derive_state(
    *, healthy: bool, heartbeat_age_s: float, metrics_age_s: float | None, settings: Settings
) -> WorkerState:
    """State from liveness facts. Metric age never makes a worker down: SGLang is silent when idle."""
    if not healthy or heartbeat_age_s > settings.down_after_s:
        return WorkerState.DOWN
    if metrics_age_s is None or metrics_age_s > settings.idle_after_s:
        return WorkerState.IDLE
    return WorkerState.LIVE


def sum_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Whole-worker metrics from its DP ranks: counts add up, fractions are token-weighted."""
    if not ranks:
        return None
    if len(ranks) == 1:
        return dict(ranks[0])
    out: dict[str, Any] = {f: sum(r[f] for r in ranks) for f in KV_METRICS_FIELDS[:5]}
    total = out["kv_total_blocks"]
    for f in ("gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate"):
        if total:
            out[f] = sum(r[f] * r["kv_total_blocks"] for r in ranks) / total
        else:
            out[f] = sum(r[f] for r in ranks) / len(ranks)
        out[f] = min(1.0, max(0.0, out[f])) if math.isfinite(out[f]) else 0.0
    out["data_parallel_rank"] = 0
    return out
