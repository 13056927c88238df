"""What a kvroute `server_cls` replica asks of its engine (no Ray): the user's options
(`LLMConfig.experimental_configs["kvroute"]`) and the SGLang engine kwargs that make the engine send
KvMetrics and, in exact prefix mode, KV events to kvroute's KV-log actor."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["OPTIONS_KEY", "KvrouteServerOptions", "options_of", "sglang_metrics_kwargs"]

OPTIONS_KEY = "kvroute"


class KvrouteServerOptions(BaseModel):
    """`LLMConfig.experimental_configs["kvroute"]`: how a replica joins kvroute's metrics plane."""

    model_config = ConfigDict(extra="forbid")

    metrics_endpoint: str | None = Field(
        None, description="ipc:// address the replica binds for its scheduler's KvMetrics (default: a per-replica "
        "path in the node's temp dir)")
    settings: dict[str, Any] = Field(default_factory=dict, description="metrics-plane Settings overrides")
    kv_events: bool = Field(
        False, description="exact prefix mode: the engine publishes its KV events to a per-replica KV-log actor "
        "that request routers with a `tokenizer` follow (the engine's `kv_events_config` is kvroute's then)")


def options_of(llm_config: Any) -> KvrouteServerOptions:
    raw = (getattr(llm_config, "experimental_configs", None) or {}).get(OPTIONS_KEY, {})
    try:
        return KvrouteServerOptions.model_validate(raw)
    except Exception as exc:
        raise ValueError(f"LLMConfig.experimental_configs[{OPTIONS_KEY!r}]: {exc}") from None


def sglang_metrics_kwargs(engine_kwargs: dict[str, Any], kv_events_config: dict[str, Any] | None = None,
                          ) -> dict[str, Any]:
    """`engine_kwargs` plus what SGLang needs to send KvMetrics, keeping what the user set; with
    `kv_events_config` (exact mode: kvroute's KV-log actor's address) that one, as SGLang's JSON.
    Raises ValueError if the user set a `kv_events_config` of their own too (one PUB per engine)."""
    out = dict(engine_kwargs)
    out.setdefault("enable_metrics", True)
    if kv_events_config is not None:
        if out.get("kv_events_config") is not None:
            raise ValueError("engine_kwargs.kv_events_config is set, and experimental_configs['kvroute'].kv_events "
                             "needs the engine's KV events for kvroute's KV log: remove one of the two")
        out["kv_events_config"] = json.dumps(kv_events_config)
    elif out.get("kv_events_config") is None:
        from actors.ports import free_port

        # no subscriber: SGLang's PUB connects to a free port nobody listens on (as for managed engines)
        out["kv_events_config"] = json.dumps(
            {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://127.0.0.1:{free_port('127.0.0.1')}"})
    return out
