"""The `dynamo-kv` benchmark peer: a small HTTP proxy whose choice is NVIDIA Dynamo's KV router.

    python -m bench.dynamo_kv --name dynamo-kv --port P --config FILE      (bench.targets starts it)

The decision is `dynamo.llm.SelectionService` of PyPI `ai-dynamo-runtime==1.6.1` — Dynamo's
runtime-free selection core, in-process (no NATS, etcd or discovery), driven the way Ray Serve
LLM's `KVAwareRouter` drives it (ray: `llm/_internal/serve/routing_policies/kv_aware/
kv_token_tracker.py`):

- at start, `upsert_worker` per simulated worker with its KV-event PUB (and replay ROUTER): the
  service SUBs to the engine's SGLang 0.5.23 frames itself, as it does for real SGLang;
- per request, the prompt tokenized exactly as kvroute's exact mode does
  (`serve_app.prompt_tokens.body_token_ids` with the simulator's tokenizer and template), then
  `select_and_reserve` (the selection books the load before it returns);
- the moments of the request: `prefill_complete` at the first streamed chunk (the simulated
  server, like SGLang, writes its role chunk with the first token, after prefill),
  `add_output_block` per output block crossed (with Ray's decay fraction: the share of
  `max_tokens` still to come), `free_reservation` at the end, whatever the end.

Load is the service's own reservation book; worker-reported metrics are not an input (Dynamo's
design). Weights come from `DYN_ROUTER_*` variables read when the service is built (one process
per configuration: `VARIANTS`). The pass-through to the worker is kvroute's own
(`serve_app.proxy.UpstreamClient`, the same 50 ms stream batching), so the proxy is not what
differs; the HTTP front is aiohttp. Dynamo's per-selection INFO log is turned down (`DYN_LOG`),
as kvroute logs no line per request by default.

Field names sent to the service are 1.6.1's (its catalog record echoes them; unknown keys are
accepted silently, so the test checks the echo).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from serve_app.prompt_tokens import SimTokenizer, body_token_ids  # noqa: E402
from serve_app.proxy import UpstreamClient, UpstreamError, forward_headers  # noqa: E402

log = logging.getLogger("bench.dynamo_kv")

MODEL = "default"  # one model: the service keys workers, index and load by model name
# target name → the DYN_ROUTER_* overrides of its process (everything else is Dynamo 1.6.1's default:
# overlap_score_credit 1.0, prefill_load_scale 1.0, decode_active_request_weight 0, temperature 0,
# use_kv_events true, track_active_blocks true, track_output_blocks false, assume_kv_reuse true,
# track_prefill_tokens true, no queue threshold, approximate-mode TTL 120 s)
VARIANTS: dict[str, dict[str, str]] = {
    "dynamo-kv": {},
    "dynamo-kv-load": {"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0"},
    "dynamo-kv-approx": {"DYN_ROUTER_USE_KV_EVENTS": "false"},
}
LABELS = {
    "dynamo-kv": "Dynamo 1.6.1 KV router (defaults)",
    "dynamo-kv-load": "Dynamo 1.6.1 KV router, load only (overlap credit 0)",
    "dynamo-kv-approx": "Dynamo 1.6.1 KV router, approximate (no KV events)",
}
# what every variant's process also gets: no per-selection INFO line on stderr
QUIET_ENV = {"DYN_LOG": "warn"}


def variant_env(name: str) -> dict[str, str]:
    """The environment overrides of target `name` (raises KeyError for an unknown one)."""
    return {**QUIET_ENV, **VARIANTS[name]}


def worker_record(i: int, w: dict[str, Any]) -> dict[str, Any]:
    """The `upsert_worker` JSON of bench worker `w` (its id is i + 1: the service wants ids ≥ 1)."""
    rec: dict[str, Any] = {
        "worker_id": i + 1, "model_name": MODEL, "endpoint": w["url"], "block_size": int(w["page_size"]),
        "total_kv_blocks": int(w["total_kv_blocks"]), "max_num_batched_tokens": int(w["max_num_batched_tokens"]),
        "data_parallel_start_rank": 0, "data_parallel_size": 1,
    }
    if w.get("kv_events_endpoint"):
        rec["kv_events_endpoints"] = {0: w["kv_events_endpoint"]}
    if w.get("kv_events_replay_endpoint"):
        rec["replay_endpoint"] = w["kv_events_replay_endpoint"]
    return rec


class DynamoProxy:
    """OpenAI chat/completions in, Dynamo's pick, kvroute's pass-through out."""

    def __init__(self, name: str, workers: list[dict[str, Any]], batching_s: float,
                 decisions: Path | None = None) -> None:
        self.name = name
        self.workers = workers
        self.batching_s = batching_s
        self.block_size = int(workers[0]["page_size"])
        self.by_id = {i + 1: w for i, w in enumerate(workers)}
        self.ids = list(self.by_id)
        self.tok = SimTokenizer()
        self.upstream = UpstreamClient(2.0, 600.0)
        self.svc: Any = None
        self.records: list[dict[str, Any]] = []
        self._seq = itertools.count()
        self._decisions = open(decisions, "a", buffering=1) if decisions else None

    async def start(self) -> None:
        from dynamo.llm import SelectionService

        self.svc = SelectionService()  # reads DYN_ROUTER_* now
        for i, w in enumerate(self.workers):
            self.records.append(await self.svc.upsert_worker(worker_record(i, w)))

    async def close(self) -> None:
        if self.svc is not None:
            self.svc.shutdown()
        await self.upstream.aclose()
        if self._decisions is not None:
            self._decisions.close()

    # ---------------------------------------------------------------- routes

    async def health(self, request: web.Request) -> web.Response:
        ready = self.svc.ready() if self.svc is not None else {"ready": False}
        return web.json_response(ready, status=200 if ready.get("ready") else 503)

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response(self.svc.loads(model_name=MODEL))

    async def workers_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.records)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "invalid JSON"}}, status=400)
        ids = body_token_ids(self.tok, body)
        if not ids:
            return web.json_response({"error": {"message": "no prompt to tokenize"}}, status=400)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        sid = f"{self.name}-{next(self._seq)}"
        t0 = time.perf_counter()
        sel = await self.svc.select_and_reserve({
            "model_name": MODEL, "selection_id": sid, "token_ids": list(ids),
            "expected_output_tokens": max_tokens, "allowed_worker_ids": self.ids,
        })
        decide_ms = (time.perf_counter() - t0) * 1e3
        wid = sel["worker_id"]
        worker = self.by_id[wid]
        if self._decisions is not None:
            self._decisions.write(json.dumps({
                "t": time.time(), "id": sid, "worker": worker["name"], "prompt_tokens": len(ids),
                "overlap_tokens": sel["overlap"]["longest_matched"],
                "effective_prefill_tokens": sel["effective_prefill_tokens"],
                "potential_decode_blocks": sel.get("potential_decode_blocks"), "decide_ms": round(decide_ms, 3),
            }) + "\n")
        try:
            up = await self.upstream.open(worker["name"], "POST", worker["url"] + request.path, content=raw,
                                          headers=forward_headers(request.headers))
        except UpstreamError as exc:
            await self.svc.free_reservation(sid)
            return web.json_response({"error": {"message": str(exc)}}, status=503)
        headers = {"x-bench-worker": worker["name"]}
        if up.content_type:
            headers["content-type"] = up.content_type
        try:
            if not body.get("stream"):
                content = await up.read()
                await self.svc.prefill_complete(sid)
                return web.Response(body=content, status=up.status_code, headers=headers)
            resp = web.StreamResponse(status=up.status_code, headers=headers)
            await resp.prepare(request)
            prompt = len(ids)
            blocks = math.ceil(prompt / self.block_size)
            out = 0
            first = True
            async for chunk in up.chunks(self.batching_s):
                if first:
                    first = False
                    await self.svc.prefill_complete(sid)
                    out -= 1  # the role chunk's empty "content" is no token
                out += chunk.count(b'"content"')
                total = math.ceil((prompt + max(0, out)) / self.block_size)
                if total > blocks:
                    decay = max(0.0, 1.0 - out / max_tokens) if max_tokens else None
                    for _ in range(total - blocks):
                        self.svc.add_output_block(sid, decay_fraction=decay)
                    blocks = total
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            await up.close()
            await self.svc.free_reservation(sid)


def build_app(proxy: DynamoProxy) -> web.Application:
    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_post("/v1/completions", proxy.chat)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/dynamo/loads", proxy.loads)
    app.router.add_get("/dynamo/workers", proxy.workers_route)

    async def on_startup(app: web.Application) -> None:
        await proxy.start()

    async def on_cleanup(app: web.Application) -> None:
        await proxy.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dynamo_kv", description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="the target's name (selection ids, the CPU family)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--config", required=True,
                    help="JSON file: {workers: [{name, url, page_size, total_kv_blocks, max_num_batched_tokens, "
                         "kv_events_endpoint, kv_events_replay_endpoint}], batching_s}")
    ap.add_argument("--decisions", default=None, help="append one JSON line per decision here")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cfg = json.loads(Path(ns.config).read_text())
    try:
        import uvloop

        uvloop.install()  # ai-dynamo-runtime depends on it; Serve's replicas run on it too
    except ImportError:  # pragma: no cover
        pass
    proxy = DynamoProxy(ns.name, cfg["workers"], float(cfg.get("batching_s", 0.05)),
                        Path(ns.decisions) if ns.decisions else None)
    web.run_app(build_app(proxy), host=ns.host, port=ns.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
