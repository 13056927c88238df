"""Every setting of a simulated SGLang worker in one place: CLI flags, engine model, defaults.

Timing defaults model Llama-3.1-8B (bf16) served by SGLang on one H100 80GB:

- prefill: 5 ms launch/scheduling overhead + 60 µs per uncached prompt token
  (≈ 16.7k prefill tokens/s, within the 10-20k tokens/s SGLang reaches for an 8B model;
  a 2k-token prompt gets a ≈ 125 ms TTFT on an idle engine).
- decode step: 8 ms + 0.15 ms per running request + 40 ns per KV token read by attention
  (weights are 16 GB at ~3.35 TB/s ≈ 5 ms, plus overhead, so batch 1 runs ≈ 120 tokens/s per
  stream; 128 requests × 1k context ≈ 32 ms/step ≈ 4k tokens/s aggregate). 40 ns/token is the
  128 KiB of KV one Llama-8B token holds, read at HBM bandwidth.
- KV pool: 400k tokens (what SGLang reports as max_total_num_tokens for this model/GPU at
  mem_fraction_static≈0.88), pages of 16 tokens, at most 1024 running requests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sim.disagg import DisaggConfig
from sim.sglang_shapes import DEFAULT_WIRE, WIRE_FORMS

KvEventsEncoding = Literal["array", "map"]


class EngineConfig(BaseModel):
    """The engine model: capacity, batching limits and the time cost of each batch (sim seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    page_size: int = Field(16, ge=1, description="tokens per KV page (SGLang --page-size)")
    max_total_num_tokens: int = Field(
        400_000, ge=1, description="KV pool size in tokens; floored to a multiple of page_size"
    )
    max_running_requests: int = Field(1024, ge=1, description="decode batch size limit")
    max_prefill_tokens: int = Field(
        16_384, ge=1, description="uncached tokens per prefill batch (a first request always fits)"
    )
    context_length: int = Field(131_072, ge=2, description="prompt + output limit per request")
    decode_log_interval: int = Field(40, ge=1, description="decode steps between KvMetrics")
    default_max_new_tokens: int = Field(
        128, ge=0, description="output length when a request names none (/generate, chat)"
    )
    prefill_base_s: float = Field(0.005, ge=0, description="fixed cost of one prefill batch")
    prefill_per_token_s: float = Field(60e-6, ge=0, description="cost per uncached prompt token")
    decode_base_s: float = Field(0.008, ge=0, description="fixed cost of one decode step")
    decode_per_req_s: float = Field(150e-6, ge=0, description="cost per running request per step")
    decode_per_kv_token_s: float = Field(40e-9, ge=0, description="attention cost per KV token")
    dp_rank: int = Field(0, ge=0, description="data_parallel_rank sent in KvMetrics")
    seed: int = Field(0, description="changes generated text (never lengths or timing)")
    round_prefill_usage: bool = Field(
        False, description="round token_usage to 2 decimals in prefill reports (SGLang 0.4.9)"
    )
    round_usage: bool = Field(
        False, description="round token_usage to 2 decimals in every report, prefill and decode (SGLang "
        "0.5.23: pool_stats_observer.update_scheduler_stats; seen on the real server)"
    )
    decode_keeps_hit_rate: bool = Field(
        False, description="decode reports carry the last prefill's cache hit rate instead of 0.0 (SGLang "
        "0.5.23: 'cache_hit_rate is prefill-owned; decode ticks must not reset it'; seen on the real server)"
    )
    record_kv_events: bool = Field(False, description="collect BlockStored/BlockRemoved events")
    max_loras_per_batch: int | None = Field(
        None, ge=1, description="distinct adapters (the base model counted as one) a running batch may hold "
        "(SGLang --max-loras-per-batch; None: LoRA off, no limit)")

    @property
    def num_pages(self) -> int:
        return self.max_total_num_tokens // self.page_size

    @property
    def pool_tokens(self) -> int:
        """max_total_num_tokens as the engine reports it: whole pages only, like SGLang."""
        return self.num_pages * self.page_size

    @model_validator(mode="after")
    def _pool_holds_a_page(self) -> "EngineConfig":
        if self.max_total_num_tokens < self.page_size:
            raise ValueError(
                f"max_total_num_tokens={self.max_total_num_tokens} is smaller than one page "
                f"(page_size={self.page_size})"
            )
        return self


class SimConfig(BaseModel):
    """One simulated worker process: HTTP address, engine model, metrics and KV-event outputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    model_name: str = "meta-llama/Llama-3.1-8B-Instruct"
    time_scale: float = Field(1.0, gt=0, description="wall seconds per simulated second")
    engine: EngineConfig = EngineConfig()
    metrics_endpoint: str | None = Field(
        None, description="ZMQ endpoint the sim CONNECTS a PUSH to (the receiver binds a PULL)"
    )
    wire: str = Field(DEFAULT_WIRE, description="SGLang release whose KvMetrics frames to send")
    kv_events_endpoint: str | None = Field(
        None, description="ZMQ PUB endpoint; bound or connected as the `wire` release's SGLang decides"
    )
    kv_events_bind: bool | None = Field(None, description="SGLang's \"bind\" key (honoured from 0.5.22)")
    kv_events_replay_endpoint: str | None = Field(None, description="ZMQ ROUTER endpoint, bound")
    kv_events_encoding: KvEventsEncoding | None = Field(
        None, description="event encoding; default: the wire release's (array up to 0.5.18, map from 0.5.20)"
    )
    kv_events_topic: str = ""
    dp_size: int = Field(1, ge=1, le=64, description="attention-DP ranks behind this one server (SGLang --dp-size "
                         "with --enable-dp-attention): each its own scheduler loop, KV pool, KvMetrics and KV events")
    load_balance_method: Literal["auto", "round_robin", "follow_bootstrap_room"] = Field(
        "auto", description="how the DP controller places a request no rank is pinned for (SGLang "
        "--load-balance-method): auto = follow_bootstrap_room on a PD prefill server, else round_robin")
    kv_events_buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    shutdown_grace_s: float = Field(0.5, ge=0, description="how long open streams may finish")
    disagg: DisaggConfig | None = Field(None, description="prefill/decode disaggregation role (sim.disagg)")
    enable_lora: bool | None = Field(None, description="SGLang --enable-lora (None: on iff lora_paths is given)")
    lora_paths: tuple[str, ...] = Field((), description="SGLang --lora-paths items: PATH | NAME=PATH | JSON (sim.lora)")
    max_loras_per_batch: int = Field(8, ge=1, description="SGLang --max-loras-per-batch")

    @property
    def lora_enabled(self) -> bool:
        """SGLang's rule: --enable-lora, or (not given) any --lora-paths."""
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    @property
    def events_encoding(self) -> KvEventsEncoding:
        """The KV-event encoding the sim sends: as configured, else the wire release's own."""
        if self.kv_events_encoding is not None:
            return self.kv_events_encoding
        major, minor, patch = (int(x) for x in self.wire.split("-")[0].split("."))
        return "map" if (major, minor, patch) >= (0, 5, 20) else "array"

    @model_validator(mode="after")
    def _known_wire(self) -> "SimConfig":
        if self.wire not in WIRE_FORMS:
            raise ValueError(f"wire={self.wire!r}: expected one of {sorted(WIRE_FORMS)}")
        if self.dp_size > 1 and self.engine.dp_rank != 0:
            raise ValueError(f"dp_rank={self.engine.dp_rank} with dp_size={self.dp_size}: the ranks are 0..dp_size-1; "
                             "--dp-rank names the one rank of a server without DP")
        rel = tuple(int(x) for x in self.wire.split("-")[0].split("."))
        if self.dp_size > 1 and self.disagg is not None and rel < (0, 5, 14):
            raise ValueError(f"dp_size > 1 with a disaggregation mode needs wire 0.5.14 or later (the releases that "
                             f"read routed_dp_rank and disagg_prefill_dp_rank); wire is {self.wire}")
        if self.load_balance_method == "follow_bootstrap_room" and (self.disagg is None or self.disagg.mode != "prefill"):
            raise ValueError("load_balance_method follow_bootstrap_room is for a PD prefill server "
                             "(--disaggregation-mode prefill): other requests carry no bootstrap room")
        return self

    @property
    def balance_method(self) -> str:
        """The DP controller's method: as configured, `auto` resolved as SGLang 0.5.x does
        (`follow_bootstrap_room` on a PD prefill server, else `round_robin`)."""
        if self.load_balance_method != "auto":
            return self.load_balance_method
        return "follow_bootstrap_room" if self.disagg is not None and self.disagg.mode == "prefill" else "round_robin"
