"""`python -m sim`: one simulated SGLang worker (HTTP + KvMetrics + optional KV events)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pydantic import ValidationError

from sim.config import EngineConfig, SimConfig
from sim.disagg import DisaggConfig
from sim.sglang_shapes import DEFAULT_WIRE, WIRE_FORMS

_ENGINE_DEFAULTS = EngineConfig()


def build_parser() -> argparse.ArgumentParser:
    d = _ENGINE_DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m sim",
        description="A simulated SGLang server: OpenAI/SGLang HTTP routes, a modelled engine, "
        "KvMetrics over ZMQ PUSH (connect) and optional KV events over ZMQ PUB (bind).",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="HTTP port")
    p.add_argument("--metrics-endpoint", help="ZMQ endpoint to PUSH KvMetrics to (connect); omit for none")
    p.add_argument("--wire", default=DEFAULT_WIRE, choices=sorted(WIRE_FORMS),
                   help=f"SGLang release whose KvMetrics frames to send (default: {DEFAULT_WIRE})")
    p.add_argument("--dp-rank", type=int, default=d.dp_rank, help="data_parallel_rank in KvMetrics (without --dp-size)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="attention-DP ranks behind this server, each with its own scheduler, KV pool, KvMetrics "
                   "(data_parallel_rank set, all pushed to --metrics-endpoint) and KV events (endpoint port + rank); "
                   "a request pins one with routed_dp_rank / data_parallel_rank, else ranks take turns")
    p.add_argument("--model-name", default=SimConfig().model_name, help="served model name")
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--max-total-num-tokens", type=int, default=d.max_total_num_tokens, help="KV pool size in tokens")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--decode-log-interval", type=int, default=d.decode_log_interval)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per simulated second (0.1 = 10x faster than real time)")
    p.add_argument("--prefill-base-ms", type=float, default=d.prefill_base_s * 1e3)
    p.add_argument("--prefill-per-token-us", type=float, default=d.prefill_per_token_s * 1e6)
    p.add_argument("--decode-base-ms", type=float, default=d.decode_base_s * 1e3)
    p.add_argument("--decode-per-req-us", type=float, default=d.decode_per_req_s * 1e6)
    p.add_argument("--decode-per-kv-token-ns", type=float, default=d.decode_per_kv_token_s * 1e9)
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed, help="varies generated text, never lengths or timing")
    p.add_argument("--kv-events-config",
                   help="SGLang's JSON (publisher, endpoint, topic, replay_endpoint, bind, buffer_steps); the "
                   "PUB binds or connects as the --wire release decides, e.g. tcp://127.0.0.1:P connects")
    p.add_argument("--kv-events-endpoint", help="KV-event PUB endpoint (the config's endpoint), e.g. tcp://*:5557")
    p.add_argument("--kv-events-replay-endpoint", help="ZMQ endpoint to bind a ROUTER for replay requests")
    p.add_argument("--kv-events-encoding", choices=["array", "map"], default=None,
                   help="array: tagged arrays (SGLang <= 0.5.18); map: tagged maps (>= 0.5.20); "
                   "default: the --wire release's")
    p.add_argument("--kv-events-topic", default="")
    p.add_argument("--load-balance-method", choices=["auto", "round_robin", "follow_bootstrap_room"], default="auto",
                   help="where an unpinned request goes with --dp-size (SGLang's flag): auto = follow_bootstrap_room "
                   "on a prefill server (bootstrap_room %% dp_size), else round_robin")
    pd = p.add_argument_group("prefill/decode disaggregation (sim.disagg, docs/pd.md)")
    pd.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                    help="SGLang's flag: prefill (runs a bootstrap server, transfers KV) or decode (fetches it)")
    pdf = DisaggConfig.model_fields
    pd.add_argument("--disaggregation-bootstrap-port", type=int, default=pdf["bootstrap_port"].default,
                    help="prefill: the bootstrap server's port (SGLang's default 8998)")
    pd.add_argument("--disaggregation-transfer-per-token-us", type=float,
                    default=pdf["transfer_per_token_s"].default * 1e6,
                    help="modelled KV transfer time per uncached prompt token (default 5 µs)")
    pd.add_argument("--disaggregation-bootstrap-timeout", type=float, default=None,
                    help="prefill: seconds a prefilled request waits for its decode peer "
                    "(default: $SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT or 300, as SGLang)")
    pd.add_argument("--disaggregation-waiting-timeout", type=float, default=None,
                    help="decode: seconds a request waits for its KV "
                    "(default: $SGLANG_DISAGGREGATION_WAITING_TIMEOUT or 300, as SGLang)")
    lora = p.add_argument_group("LoRA adapters (sim.lora; SGLang's flags)")
    lora.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    lora.add_argument("--lora-paths", nargs="*", default=[],
                      help="adapters to preload: PATH | NAME=PATH | JSON {lora_name, lora_path, pinned}")
    lora.add_argument("--max-loras-per-batch", type=int, default=8,
                      help="distinct adapters in a running batch, the base model included (default 8)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    engine = EngineConfig(
        page_size=args.page_size,
        max_total_num_tokens=args.max_total_num_tokens,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        decode_log_interval=args.decode_log_interval,
        default_max_new_tokens=args.default_max_new_tokens,
        prefill_base_s=args.prefill_base_ms / 1e3,
        prefill_per_token_s=args.prefill_per_token_us / 1e6,
        decode_base_s=args.decode_base_ms / 1e3,
        decode_per_req_s=args.decode_per_req_us / 1e6,
        decode_per_kv_token_s=args.decode_per_kv_token_ns / 1e9,
        dp_rank=args.dp_rank,
        seed=args.seed,
    )
    kv = {"endpoint": args.kv_events_endpoint, "replay_endpoint": args.kv_events_replay_endpoint,
          "topic": args.kv_events_topic}
    if args.kv_events_config:
        try:
            given = json.loads(args.kv_events_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config: not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("--kv-events-config: must be a JSON object")
        kv.update({k: v for k, v in given.items() if k in ("endpoint", "replay_endpoint", "topic", "bind",
                                                             "buffer_steps")})
    disagg = None
    if args.disaggregation_mode != "null":
        timeouts = {k: v for k, v in (("bootstrap_timeout_s", args.disaggregation_bootstrap_timeout),
                                      ("waiting_timeout_s", args.disaggregation_waiting_timeout)) if v is not None}
        disagg = DisaggConfig(mode=args.disaggregation_mode, bootstrap_port=args.disaggregation_bootstrap_port,
                              transfer_per_token_s=args.disaggregation_transfer_per_token_us / 1e6, **timeouts)
    return SimConfig(
        disagg=disagg,
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        time_scale=args.time_scale,
        engine=engine,
        metrics_endpoint=args.metrics_endpoint,
        wire=args.wire,
        kv_events_endpoint=kv["endpoint"],
        kv_events_bind=kv.get("bind"),
        kv_events_replay_endpoint=kv["replay_endpoint"],
        kv_events_encoding=args.kv_events_encoding,
        kv_events_topic=kv["topic"],
        dp_size=args.dp_size,
        load_balance_method=args.load_balance_method,
        enable_lora=args.enable_lora,
        lora_paths=tuple(args.lora_paths or ()),
        max_loras_per_batch=args.max_loras_per_batch,
        **({"kv_events_buffer_steps": kv["buffer_steps"]} if "buffer_steps" in kv else {}),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s sim[{args.port}] %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        parser.error(f"{'.'.join(map(str, err['loc']))}: {err['msg']}")
    except ValueError as exc:
        parser.error(str(exc))
    from sim.server import serve  # heavy imports only once the arguments are known to be good

    try:
        serve(config, log_level=args.log_level)
    except ValueError as exc:  # a socket that cannot be bound / connected
        logging.getLogger("sim").error("worker on port %d cannot start: %s", args.port, exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
