"""Router settings and the Serve app builder's arguments (validated; unknown keys are errors)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from actors.fleet import FleetSpec, load_fleet, parse_fleet

API_KEY_ENV = "KVROUTE_API_KEY"
ADMIN_KEY_ENV = "KVROUTE_ADMIN_KEY"


class RouterConfig(BaseModel):
    """How one router deployment behaves."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field("kv_aware", description="default policy; x-kvroute-policy overrides")
    api_key: str | None = Field(None, description=f"Bearer key for every route but /healthz (env {API_KEY_ENV})")
    admin_key: str | None = Field(None, description=f"Bearer key for fleet changes (env {ADMIN_KEY_ENV})")
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="request bodies above are refused (413)")
    max_header_bytes: int = Field(64 * 1024, gt=0, description="requests with larger headers are refused (431)")
    block_size: int = Field(16, ge=1, description="prefix-index block size in tokens (= engines' page_size for exact mode)")
    tokenizer: str = Field(
        "none",
        description="tokenize prompts like the engine, for exact prefix mode from KV events: "
        "none | sim | hf:<dir with the model's tokenizer.json and chat template>",
    )
    upstream_connect_timeout_s: float = Field(
        10.0, gt=0,
        description="connecting to a worker (pool wait + TCP connect); a timeout is retried on another worker but "
        "never opens the worker's breaker (overload or this replica's own loop lag, not a dead worker: liveness "
        "probes mark dead workers down within seconds)",
    )
    upstream_read_timeout_s: float = Field(600.0, gt=0, description="per-chunk read timeout upstream")
    stream_batching_interval_ms: float = Field(
        50.0, ge=0, le=1000,
        description="streamed replies: the first two SSE events (role chunk, first token) go out at once, "
        "later chunks that arrive within this long go out together; the end is never held. "
        "0 = one piece per upstream read",
    )
    decision_log: str | None = Field(
        None, description="append one JSON line per decision to this file (time, chosen worker, reason, "
        "overlap and every candidate's view with its metrics age) — for diagnosing routing on real traffic",
    )
    max_attempts: int = Field(3, ge=1, description="tries on different workers before the first byte")
    breaker_failures: int = Field(3, ge=1, description="consecutive upstream failures that open a worker's breaker")
    breaker_open_s: float = Field(5.0, gt=0, description="seconds a worker is skipped before one probe")
    max_ongoing_requests: int = Field(1024, ge=1, description="per router replica (Serve's default is 5)")
    num_replicas: int | str = Field(1, description="router replicas, or 'auto'")
    kv_aware: dict[str, float] = Field(
        default_factory=dict, description="KvAwareConfig knobs, e.g. {queued_request_blocks: 64, tolerance: 0.2}"
    )
    seed: int | None = None

    @field_validator("kv_aware")
    @classmethod
    def _kv_aware_knobs(cls, v: dict[str, float]) -> dict[str, float]:
        from serve_app.policies.kv_aware import KvAwareConfig

        import dataclasses

        known = {f.name for f in dataclasses.fields(KvAwareConfig)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"unknown kv_aware knob(s) {unknown}; valid: {sorted(known)}")
        KvAwareConfig(**v)  # a bad value raises ValueError naming the knob
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, v: str) -> str:
        from serve_app.prompt_tokens import load_tokenizer

        load_tokenizer(v)  # TokenizerError (a ValueError) names the missing file or bad template
        return v

    @field_validator("policy")
    @classmethod
    def _policy_known(cls, v: str) -> str:
        from serve_app.policies import get_policy

        get_policy(v)  # UnknownPolicy lists the valid names
        return v

    @field_validator("api_key", "admin_key")
    @classmethod
    def _nonempty(cls, v: str | None) -> str | None:
        if v is not None and len(v) < 8:
            raise ValueError("keys must be at least 8 characters")
        return v

    def with_env(self) -> "RouterConfig":
        """Fill keys from the environment when not given explicitly."""
        upd: dict[str, Any] = {}
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            upd["api_key"] = os.environ[API_KEY_ENV]
        if self.admin_key is None and os.environ.get(ADMIN_KEY_ENV):
            upd["admin_key"] = os.environ[ADMIN_KEY_ENV]
        return self.model_validate({**self.model_dump(), **upd}) if upd else self


class AppArgs(BaseModel):
    """Arguments of `serve_app.app:build_app` (from `serve deploy` YAML `args:` or the CLI)."""

    model_config = ConfigDict(extra="forbid")

    fleet: str | FleetSpec | None = Field(
        None, description="fleet file path or inline fleet mapping; None = workers added at run time"
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each router replica requests (e.g. kvroute_head)"
    )
    manage_fleet: bool = Field(
        True, description="router replicas make sure every fleet worker has its (detached) actor"
    )

    def fleet_spec(self) -> FleetSpec | None:
        if self.fleet is None or isinstance(self.fleet, FleetSpec):
            return self.fleet
        return load_fleet(self.fleet)

    @field_validator("fleet", mode="before")
    @classmethod
    def _fleet(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return parse_fleet(v, "args.fleet")
        return v
