"""Everything the benchmark drives, started once per run against ONE simulated fleet.

`BenchFleet.start()` brings up, in this order:

1. Ray (local, private) and kvroute's own `FleetRunner`: the aggregator, one managed worker
   actor per simulated SGLang worker (all with the same engine arguments), and the kvroute app
   (default policy kv_aware) at `/`.
2. Three more kvroute apps built by the same `serve_app.app:build_app`, one per other policy
   (`/kvroute-round_robin`, …), and `kvroute-kv_aware-exact` (kv_aware with `tokenizer: sim`: exact
   prefix overlap from the engines' KV events, which every engine publishes). Separate apps, not
   the `x-kvroute-policy` header against one: a router's prefix index records every request it
   routes whatever the policy, so policies sharing one replica would start from each other's
   (flushed, hence false) affinity.
3. `serve-random`: a bare Ray Serve pass-through with the same FastAPI ingress shape and the same
   `serve_app.proxy.UpstreamClient`, picking a worker uniformly at random (Serve's own floor).
4. `ray-prefix`: Ray Serve LLM's `PrefixCacheAffinityRouter` choosing among N replicas of an
   engine deployment, each replica bound to one simulated worker and proxying to it. This is Ray
   Serve LLM's shape (OpenAI ingress → handle → engine replicas) with the in-process LLM engine
   replaced by a pass-through to the worker; see `PREFIX_NOTES`.
5. sglang-router (the real Rust gateway) once per policy: round_robin, cache_aware, power_of_two, with
   the flags its users run it with (`SGLANG_ROUTER_FLAGS`). 0.3.2 never sets TCP_NODELAY on the
   client connections it accepts, so on a keep-alive connection reused within ~40 ms a streamed
   reply's first body bytes wait for the client's delayed ACK (a TCP floor of ~40 ms, not routing
   cost). `sglang-<policy>-nodelay` runs the same binary with the same flags and an LD_PRELOAD shim
   (`bench/nodelay/`, compiled here at run time) that sets TCP_NODELAY on every socket it accepts:
   its routing cost apart from the stall (cache_aware's in a run of every target; the others when
   named in `--targets`).

6. `dynamo-kv` (and `dynamo-kv-load`, `dynamo-kv-approx`), only when named in `--targets` and with
   `--kv-events`: NVIDIA Dynamo 1.6.1's KV router (`dynamo.llm.SelectionService`) in a small proxy
   process per configuration (`bench.dynamo_kv`), subscribed to the same KV-event PUBs as kvroute.
   With `--kv-events` the engines' PUBs bind (SGLang 0.5.23's `bind: true`) so that kvroute's worker
   actors and every Dynamo process hear the same frames.

`direct` needs nothing: the load generator picks the workers round-robin itself (the floor).
`stop()` tears every piece down: routers, Serve apps, worker actors (their sims), aggregator, Ray.
"""

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.ports import free_port
from ray import serve
from ray.serve.config import RequestRouterConfig

from bench.dynamo_kv import LABELS as DYNAMO_LABELS
from bench.dynamo_kv import VARIANTS as DYNAMO_VARIANTS
from bench.dynamo_kv import variant_env as dynamo_env
from bench.loadgen import Target
from bench.sglang_peer import (NODELAY_BY_DEFAULT, NODELAY_SUFFIX, SGLANG_COMMON_FLAGS, SGLANG_NODELAY_NOTE,
                               SGLANG_DP_FLAGS, SGLANG_PD_FLAGS, SGLANG_PER_MODEL_NOTE, SGLANG_POLICIES,
                               SGLANG_ROUTER_FLAGS, SGLANG_STALL_NOTE, _sglang_router_version, sglang_router_argv,
                               sglang_router_pd_argv)
from serve_app.config import RouterConfig
from serve_app.proxy import UpstreamClient, UpstreamError, forward_headers
from serve_app.ray_env import apply_serve_env

log = logging.getLogger("bench.targets")
logging.getLogger("httpx").setLevel(logging.WARNING)
# no `from __future__ import annotations` here: Serve's FastAPI ingress must see real annotations
ROOT = Path(__file__).resolve().parents[1]

# The class `ray.serve.llm.request_router.PrefixCacheAffinityRouter` re-exports (a bare subclass); the
# public module needs the ray[llm] extra (pyarrow) only to import, the router itself does not.
PREFIX_ROUTER_CLASS = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
)
# the Serve floors relay streams like kvroute's router does by default (same proxy code, same batching,
# reading as tokens arrive; kvroute's opt-in `stream_batching_hold_reads` is not used by them)
STREAM_BATCHING_MS = RouterConfig.model_fields["stream_batching_interval_ms"].default
STREAM_BATCHING_S = STREAM_BATCHING_MS / 1e3
KVROUTE_POLICIES = ("round_robin", "power_of_two", "least_loaded", "kv_aware")
PREFIX_NOTES = (
    "Ray Serve LLM PrefixCacheAffinityRouter (ray 2.60, default kwargs: imbalanced_threshold=inf, "
    "match_rate_threshold=0.1) routing among 4 replicas of a pass-through engine deployment, one "
    "replica per simulated worker; an OpenAI ingress deployment calls it through a streaming "
    "DeploymentHandle, as Ray Serve LLM's ingress calls LLMServer. Chunks are relayed batched like "
    f"kvroute's (first at once, then every {STREAM_BATCHING_MS:g} ms; Ray Serve LLM batches every 50 ms). "
    "Its prefix tree actor is called with "
    "blocking ray.get inside the router, as shipped. The ingress signals each reply's first chunk to the "
    "request routers of its process as kvroute's OpenAiIngress does (only kvroute's router listens)."
)


# ------------------------------------------------------------------ bare Serve pass-through

passthrough_app = FastAPI()


@serve.deployment(name="PassThrough", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(passthrough_app)
class PassThrough:
    """Serve's floor: FastAPI ingress + kvroute's UpstreamClient, a uniformly random worker."""

    def __init__(self, workers: dict[str, str], batching_s: float = STREAM_BATCHING_S) -> None:
        self.workers = list(workers.items())
        self.upstream = UpstreamClient(2.0, 600.0)
        self.batching_s = batching_s

    @passthrough_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": {"message": "invalid JSON"}}, status_code=400)
        name, url = random.choice(self.workers)
        try:
            up = await self.upstream.open(name, "POST", url + "/v1/chat/completions", content=raw,
                                          headers=forward_headers(request.headers))
        except UpstreamError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=503)
        headers = {**up.headers(), "x-bench-worker": name}
        if not body.get("stream"):
            try:
                content = await up.read()
            finally:
                await up.close()
            return Response(content, status_code=up.status_code, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.chunks(self.batching_s):
                    yield chunk
            finally:
                await up.close()

        return StreamingResponse(relay(), status_code=up.status_code, headers=headers,
                                 media_type=up.content_type or "text/event-stream")


# ------------------------------------------------------------------ Ray Serve LLM's prefix router


class EngineRequest:
    """What the ingress hands to an engine replica. PrefixCacheAffinityRouter reads `.messages`
    (or `.prompt`) off the request's arguments, as it does off Ray Serve LLM's request models."""

    def __init__(self, messages: Any, raw: bytes, headers: dict[str, str]) -> None:
        self.messages = messages
        self.raw = raw
        self.headers = headers


@serve.deployment(name="SimEngine", max_ongoing_requests=int(1e9), ray_actor_options={"num_cpus": 0})
class SimEngine:
    """One replica = one simulated worker (claimed at start, first free one wins)."""

    def __init__(self, workers: dict[str, str], claim_dir: str, batching_s: float = STREAM_BATCHING_S) -> None:
        self.batching_s = batching_s
        for i, (name, url) in enumerate(workers.items()):
            try:
                os.close(os.open(os.path.join(claim_dir, f"claim-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            self.name, self.url = name, url
            break
        else:
            raise RuntimeError("more engine replicas than workers")
        self.upstream = UpstreamClient(2.0, 600.0)

    async def chat(self, req: EngineRequest) -> AsyncIterator[Any]:
        try:
            up = await self.upstream.open(self.name, "POST", self.url + "/v1/chat/completions", content=req.raw,
                                          headers=req.headers)
        except UpstreamError as exc:
            yield (self.name, 503, {})
            yield json.dumps({"error": {"message": str(exc)}}).encode()
            return
        yield (self.name, up.status_code, up.headers())
        try:
            async for chunk in up.chunks(self.batching_s):
                yield chunk
        finally:
            await up.close()


@serve.deployment(name="SimEngine", max_ongoing_requests=int(1e9), ray_actor_options={"num_cpus": 0})
class NamedSimEngine(SimEngine.func_or_class):
    """SimEngine that names its worker in Serve's routing stats, so kvroute's RequestRouter finds it."""

    def record_routing_stats(self) -> dict[str, Any]:
        from serve_app.ray_llm.names import ROUTING_STATS_KEY

        return {ROUTING_STATS_KEY: self.name}


# Ray Serve's shape of `ray-prefix` (same ingress, same pass-through replicas) with other request routers
KVROUTE_REQUEST_ROUTER = "serve_app.ray_llm.request_router:KvRouteRequestRouter"
SERVE_ROUTER_TARGETS = {
    "ray-kvroute": (KVROUTE_REQUEST_ROUTER, "Ray Serve + kvroute RequestRouter",
                    "kvroute's Serve RequestRouter (kv_aware, the aggregator's KvMetrics, its own ledger and prefix "
                    "index) ranking the same pass-through replicas as ray-prefix, behind the same ingress"),
    "ray-pow2": (None, "Ray Serve power of two (default router)",
                 "Serve's default request router over the same pass-through replicas as ray-prefix"),
    # needs --kv-events (the workers' actors then keep KV logs the router follows)
    "ray-kvroute-exact": (KVROUTE_REQUEST_ROUTER, "Ray Serve + kvroute RequestRouter, exact prefix mode",
                          "ray-kvroute with `request_router_kwargs: {tokenizer: sim, render_chat: false}`: prompts tokenized like the "
                          "engine, overlap from the engines' KV events (followed from the workers' KV logs)"),
}
# pass-through replicas forward the OpenAI body to the sim's HTTP server, which applies the chat template
# itself (SGLang's own server path), not Ray's SGLangServer's render-then-tokenize: render_chat false
SERVE_ROUTER_KWARGS = {"ray-kvroute-exact": {"tokenizer": "sim", "render_chat": False}}


prefix_app = FastAPI()


@serve.deployment(name="PrefixIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(prefix_app)
class PrefixIngress:
    def __init__(self, engine: Any) -> None:
        self.engine = engine.options(stream=True)

    @prefix_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": {"message": "invalid JSON"}}, status_code=400)
        from ray.serve.context import _get_serve_request_context

        from serve_app.ray_llm.first_token import first_token

        # Serve's id of this request, the one the handle's request router saw (kvroute's, for ray-kvroute)
        rid = _get_serve_request_context()._internal_request_id
        gen = self.engine.chat.remote(EngineRequest(body.get("messages"), raw, forward_headers(request.headers)))
        name, status, headers = await gen.__anext__()
        headers = {**headers, "x-bench-worker": name}

        async def relay() -> AsyncIterator[bytes]:
            first = True
            async for chunk in gen:
                if first and rid:  # the first token arrived (the relay's first chunk carries it): tell the
                    first = False  # routers of this process, as kvroute's OpenAiIngress does (no-op for others)
                    first_token(rid)
                yield chunk

        return StreamingResponse(relay(), status_code=status, headers=headers,
                                 media_type=headers.get("content-type", "text/event-stream"))


def _dynamo_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ai-dynamo-runtime")
    except PackageNotFoundError:
        return "?"


# ------------------------------------------------------------------ the fleet and every router


@dataclass
class BenchFleet:
    workers: int
    engine_args: dict[str, Any]
    verbose: bool = False
    progress: Any = print
    targets_enabled: tuple[str, ...] | None = None  # None = all
    decision_log_dir: Path | None = None  # every kvroute target logs its decisions there
    kv_events: bool = False  # engines publish KV events + the kv_aware exact-mode target (see run.py)
    router_args: dict[str, Any] = field(default_factory=dict)  # RouterConfig fields for every kvroute app
    plane_settings: dict[str, Any] = field(default_factory=dict)  # the fleet file's `settings:` (metrics plane)
    dp_size: int = 1  # attention-DP ranks per worker (sim --dp-size; sglang-router then runs --dp-aware)
    # several: a multi-model fleet (workers split into equal contiguous shares, one model each); the
    # targets that cannot route by model (Serve's model-blind floors) are left out
    models: tuple[str, ...] = ()
    pd: tuple[int, int] | None = None  # (prefill, decode) sims instead of `workers` ordinary ones (docs/pd.md)
    tmpdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="kvroute-bench-"))
    serve_port: int = 0
    worker_urls: dict[str, str] = field(default_factory=dict)
    _runner: Any = None
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _targets: list[Target] = field(default_factory=list)
    _ray_started: bool = False
    _pd_workers: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    _kv_endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)

    def _batching_s(self) -> float:
        """The bare Serve floor relays like the kvroute apps of this fleet."""
        return float(self.router_args.get("stream_batching_interval_ms", STREAM_BATCHING_MS)) / 1e3

    def model_of(self, i: int) -> str | None:
        """The model worker i serves in a multi-model fleet (contiguous equal shares), else None."""
        if len(self.models) <= 1:
            return None
        return self.models[i * len(self.models) // self.workers]

    def workers_of(self) -> dict[str, tuple[str, ...]]:
        """model → its workers' URLs (multi-model fleets)."""
        out: dict[str, list[str]] = {}
        for i, url in enumerate(self.worker_urls.values()):
            out.setdefault(self.model_of(i), []).append(url)
        return {m: tuple(u) for m, u in out.items()}

    def _kv_endpoints_of(self, name: str) -> dict[str, Any]:
        """A worker's KV-event publisher: bound on loopback, with a replay endpoint (kept for Dynamo)."""
        ep = self._kv_endpoints.get(name)
        if ep is None:
            ep = self._kv_endpoints[name] = {
                "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}", "kv_events_bind": True,
                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
        return ep

    def fleet_dict(self) -> dict[str, Any]:
        if len(self.models) > 1 and self.workers < len(self.models):
            raise ValueError(f"{self.workers} workers cannot serve {len(self.models)} models")
        ws = []
        roles = ([("prefill", f"prefill-{i}") for i in range(self.pd[0])] + [("decode", f"decode-{i}") for i in range(self.pd[1])]
                 if self.pd else [("both", f"sim-{i}") for i in range(self.workers)])
        for i, (role, name) in enumerate(roles):
            port = free_port()
            model = self.model_of(i)
            ws.append({
                "name": name, "role": role, **({"bootstrap_port": free_port()} if role == "prefill" else {}),
                "engine": "sim", "page_size": int(self.engine_args.get("page_size", 16)),
                "url": f"http://127.0.0.1:{port}", "metrics_endpoint": f"ipc://{self.tmpdir}/{name}.metrics",
                # one model: the load generators ask for "default"; several: each worker serves its own
                "model": model or "kvroute-sim",
                "served_model_names": [model] if model else ["kvroute-sim", "default"],
                # every engine publishes SGLang KV events (kvroute's exact prefix mode and Dynamo read them;
                # the engine's timing is unchanged and the other targets ignore them). The PUB binds (SGLang
                # 0.5.23's `bind: true`) so that several subscribers hear the same frames: kvroute's worker
                # actor and each dynamo-kv process connect to it, and ask its replay ROUTER for lost batches
                **((self._kv_endpoints_of(name) if self.dp_size == 1 and not self.pd else {"kv_events_endpoint": "auto"})
                   if self.kv_events else {}),
                "engine_args": {k: v for k, v in self.engine_args.items() if k != "page_size"},
                **({"dp_size": self.dp_size} if self.dp_size > 1 else {}),
            })
        return {"workers": ws, **({"settings": self.plane_settings} if self.plane_settings else {})}

    # ---------------------------------------------------------------- start

    def start(self) -> list[Target]:
        import ray

        from actors.fleet import parse_fleet
        from serve_app.app import build_app
        from serve_app.cli import FleetRunner
        from serve_app.config import RouterConfig

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray workers must import `bench` (the Serve deployments below live here)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        if not ray.is_initialized():
            apply_serve_env()  # the transport `kvroute serve` runs with (every Serve target here)
            self.progress("starting Ray (local) …")
            from actors.models import NAMESPACE

            ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=self.verbose)
            self._ray_started = True
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        fleet = parse_fleet(self.fleet_dict(), "bench")
        self.serve_port = free_port()
        def dlog(target: str) -> dict[str, str]:
            d = self.decision_log_dir
            return {"decision_log": str(d / f"decisions-{target}.jsonl")} if d is not None else {}

        self._runner = FleetRunner(fleet, RouterConfig(policy="kv_aware", **self.router_args,
                                                       **dlog("kvroute-kv_aware")), host="127.0.0.1",
                                   port=self.serve_port, address=None, progress=self.progress, verbose=self.verbose)
        base = self._runner.start()
        self.worker_urls = {w.name: w.url for w in fleet.expanded()}
        self._pd_workers = {w.name: (w.role, w.bootstrap_port) for w in fleet.expanded() if w.role != "both"}
        urls = tuple(self.worker_urls.values())
        want = self.targets_enabled
        multi = len(self.models) > 1
        per_model = self.workers_of() if multi else {}
        model_blind = ("serve-random", "ray-prefix", *SERVE_ROUTER_TARGETS)
        if multi:
            skipped = [n for n in model_blind if want is None or n in want]
            if skipped:
                self.progress(f"multi-model fleet: leaving out {', '.join(skipped)} (they cannot route by model)")
        on = ((lambda name: True) if want is None else (lambda name: name in want)) if not multi else (
            (lambda name: name not in model_blind and (want is None or name in want)))

        targets: list[Target] = []
        if on("direct"):
            targets.append(Target("direct", urls, label="direct (client RR)", by_model=per_model,
                                  notes="no router: the load generator round-robins over the workers"
                                        + (" of the model each request names" if multi else "")))
        if on("serve-random"):
            serve.run(PassThrough.bind(self.worker_urls, self._batching_s()), name="serve-random",
                      route_prefix="/serve-random", blocking=False)
            targets.append(Target("serve-random", (base + "/serve-random",), label="bare Serve (random)"))
        for policy in KVROUTE_POLICIES:
            name = f"kvroute-{policy}"
            if not on(name):
                continue
            if policy == "kv_aware":
                prefix = ""  # FleetRunner's own app
            else:
                prefix = f"/{name}"
                # as FleetRunner does: this process owns the worker actors, the replicas must not start them
                args = {"fleet": fleet.model_dump(mode="json"),
                        "router": {**self.router_args, "policy": policy, **dlog(name)}, "manage_fleet": False}
                serve.run(build_app(args), name=name, route_prefix=prefix, blocking=False)
            targets.append(Target(name, (base + prefix,), label=f"kvroute {policy}"))
        name = "kvroute-kv_aware-exact"
        if self.kv_events and on(name):
            prefix = f"/{name}"
            args = {"fleet": fleet.model_dump(mode="json"),
                    "router": {**self.router_args, "policy": "kv_aware", "tokenizer": "sim", **dlog(name)},
                    "manage_fleet": False}
            serve.run(build_app(args), name=name, route_prefix=prefix, blocking=False)
            targets.append(Target(name, (base + prefix,), label="kvroute kv_aware, exact prefix mode",
                                  notes="router config `tokenizer: sim`: prompts tokenized like the engine, overlap "
                                        "from the engines' KV events (what they hold now) instead of the router's "
                                        "record of what it sent where"))
        if on("ray-prefix"):
            claim = os.path.join(self.tmpdir, "claims")
            os.makedirs(claim, exist_ok=True)
            engine = SimEngine.options(
                num_replicas=len(urls),
                request_router_config=RequestRouterConfig(
                    request_router_class=PREFIX_ROUTER_CLASS),
            ).bind(self.worker_urls, claim, self._batching_s())
            serve.run(PrefixIngress.bind(engine), name="ray-prefix", route_prefix="/ray-prefix", blocking=False)
            targets.append(Target("ray-prefix", (base + "/ray-prefix",), label="Ray Serve PrefixCacheAffinity",
                                  notes=PREFIX_NOTES))
        for name, (router_cls, label, notes) in SERVE_ROUTER_TARGETS.items():
            if want is None or not on(name):  # only when named (--targets): the suites' runs stay as they are
                continue
            kwargs = SERVE_ROUTER_KWARGS.get(name)
            if kwargs and not self.kv_events:
                self.progress(f"{name}: needs --kv-events (engines publishing KV events); left out")
                continue
            claim = os.path.join(self.tmpdir, f"claims-{name}")
            os.makedirs(claim, exist_ok=True)
            if kwargs:  # the router's blocks are the engines' pages
                kwargs = {**kwargs, "router": {"block_size": int(self.engine_args.get("page_size", 16))}}
            rrc = {"request_routing_stats_period_s": 1.0, **({"request_router_class": router_cls} if router_cls else {}),
                   **({"request_router_kwargs": kwargs} if kwargs else {})}
            engine = NamedSimEngine.options(num_replicas=len(urls), request_router_config=RequestRouterConfig(**rrc)
                                            ).bind(self.worker_urls, claim, self._batching_s())
            serve.run(PrefixIngress.bind(engine), name=name, route_prefix=f"/{name}", blocking=False)
            targets.append(Target(name, (base + f"/{name}",), label=label, notes=notes))
        for name in DYNAMO_VARIANTS:
            if want is None or not on(name) or self.pd or self.dp_size > 1:  # only when named (--targets)
                continue
            if not self.kv_events:
                self.progress(f"{name}: needs --kv-events (engines publishing KV events); left out")
                continue
            port = free_port()
            self._start_dynamo(name, port)
            env = " ".join(f"{k}={v}" for k, v in dynamo_env(name).items())
            targets.append(Target(name, (f"http://127.0.0.1:{port}",), label=DYNAMO_LABELS[name],
                                  notes=f"ai-dynamo-runtime {_dynamo_version()} `dynamo.llm.SelectionService` in an "
                                        f"aiohttp proxy (bench/dynamo_kv.py) relaying with kvroute's UpstreamClient "
                                        f"and {self._batching_s() * 1e3:g} ms stream batching; environment `{env}`"))
        version = _sglang_router_version()
        for policy in SGLANG_PD_FLAGS if self.pd else ():
            name = f"sglang-pd-{policy}"
            if not on(name):
                continue
            port = free_port()
            prefill = [(self.worker_urls[n], bp) for n, (r, bp) in self._pd_workers.items() if r == "prefill"]
            decode = [self.worker_urls[n] for n, (r, _) in self._pd_workers.items() if r == "decode"]
            self._start_sglang_router(name, policy, port, urls,
                                      argv=sglang_router_pd_argv(policy, port, prefill, decode, free_port()))
            targets.append(Target(name, (f"http://127.0.0.1:{port}",), label=f"sglang-router PD {policy}",
                                  notes=f"sglang-router {version} --pd-disaggregation. Flags: "
                                        f"`{' '.join(SGLANG_PD_FLAGS[policy])} {' '.join(SGLANG_COMMON_FLAGS)}`"))
        for policy in SGLANG_POLICIES if not self.pd else ():
            for nodelay in (False, True):
                name = f"sglang-{policy}{NODELAY_SUFFIX if nodelay else ''}"
                if not on(name) or (nodelay and want is None and policy not in NODELAY_BY_DEFAULT):
                    continue
                flags = " ".join((*SGLANG_ROUTER_FLAGS[policy], *(SGLANG_DP_FLAGS if self.dp_size > 1 else ())))
                if multi:
                    # one router per model over that model's workers: 0.3.2's multi-model gateway
                    # mode (--enable-igw) panics at start without internet access (it downloads the
                    # o200k_base vocabulary for its harmony parser), so this is how it runs here
                    by_model = {}
                    for model, murls in per_model.items():
                        port = free_port()
                        self._start_sglang_router(f"{name}@{model}", policy, port, murls, nodelay=nodelay)
                        by_model[model] = (f"http://127.0.0.1:{port}",)
                    label = f"sglang-router {policy}{', TCP_NODELAY forced' if nodelay else ''}, one per model"
                    notes = (SGLANG_NODELAY_NOTE if nodelay else SGLANG_STALL_NOTE).format(version=version)
                    targets.append(Target(name, tuple(u for us in by_model.values() for u in us), label=label,
                                          by_model=by_model, notes=f"{notes}. {SGLANG_PER_MODEL_NOTE} Flags: "
                                                                   f"`{flags} {' '.join(SGLANG_COMMON_FLAGS)}`"))
                    continue
                port = free_port()
                self._start_sglang_router(name, policy, port, urls, nodelay=nodelay)
                if nodelay:
                    label = f"sglang-router {policy}, TCP_NODELAY forced"
                    notes = SGLANG_NODELAY_NOTE.format(version=version)
                else:
                    label = f"sglang-router {policy} (TCP delayed-ACK floor)"
                    notes = SGLANG_STALL_NOTE.format(version=version)
                targets.append(Target(name, (f"http://127.0.0.1:{port}",), label=label,
                                      notes=f"{notes}. Flags: `{flags} {' '.join(SGLANG_COMMON_FLAGS)}`"))
        self._targets = targets
        self._wait_ready(targets)
        return targets

    def _start_dynamo(self, name: str, port: int) -> None:
        """One bench.dynamo_kv process (one Dynamo configuration: its DYN_ROUTER_* are read at start)."""
        page = int(self.engine_args.get("page_size", 16))
        workers = [{"name": n, "url": u, "page_size": page,
                    "total_kv_blocks": int(self.engine_args.get("max_total_num_tokens", 400_000)) // page,
                    "max_num_batched_tokens": int(self.engine_args.get("max_prefill_tokens", 16_384)),
                    **{k: v for k, v in self._kv_endpoints[n].items() if k != "kv_events_bind"}}
                   for n, u in self.worker_urls.items()]
        cfg = os.path.join(self.tmpdir, f"{name}.json")
        Path(cfg).write_text(json.dumps({"workers": workers, "batching_s": self._batching_s()}))
        argv = [sys.executable, "-m", "bench.dynamo_kv", "--name", name, "--port", str(port), "--config", cfg]
        if self.decision_log_dir is not None:
            argv += ["--decisions", str(self.decision_log_dir / f"decisions-{name}.jsonl")]
        env = {**os.environ, **dynamo_env(name)}
        env.pop("LD_PRELOAD", None)
        logf = open(os.path.join(self.tmpdir, f"{name}.log"), "wb")
        self._procs[name] = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                             start_new_session=True)
        logf.close()

    def _start_sglang_router(self, name: str, policy: str, port: int, urls: tuple[str, ...],
                             nodelay: bool = False, argv: list[str] | None = None) -> None:
        argv = argv or sglang_router_argv(policy, port, urls, free_port(), dp_aware=self.dp_size > 1)
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if nodelay:
            from bench.nodelay import shim_path

            env["LD_PRELOAD"] = " ".join(p for p in (str(shim_path()), env.get("LD_PRELOAD", "")) if p)
        else:
            env.pop("LD_PRELOAD", None)
        logf = open(os.path.join(self.tmpdir, f"{name}.log"), "wb")
        self._procs[name] = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        logf.close()

    def _wait_ready(self, targets: list[Target], timeout_s: float = 120.0) -> None:
        """Every target answers a tiny chat request (and kvroute apps see every worker live/idle)."""
        self.progress("waiting for every target to answer …")
        deadline = time.monotonic() + timeout_s
        def body(model: str) -> dict[str, Any]:
            return {"model": model, "messages": [{"role": "user", "content": "ready"}], "max_tokens": 1}

        models = list(self.models) if len(self.models) > 1 else ["default"]
        with httpx.Client(timeout=10, trust_env=False) as c:
            for t in targets:
                # every URL of the target, asked for a model it serves (a model-routing router: every model)
                probes = ([(u + "/v1/chat/completions", m) for m, us in t.by_model.items() for u in us]
                          if t.by_model else [(t.endpoint(i), m) for i in range(len(t.urls)) for m in models])
                while True:
                    for pname, proc in self._procs.items():
                        if pname.partition("@")[0] == t.name and proc.poll() is not None:
                            raise RuntimeError(f"{pname} exited with status {proc.returncode}; see "
                                               f"{self.tmpdir}/{pname}.log")
                    try:
                        ok = True
                        if t.name.startswith("kvroute-"):
                            ws = c.get(t.urls[0] + "/workers").json()["workers"]
                            ok = len(ws) == self.workers and all(w["state"] in ("live", "idle") for w in ws)
                        if ok:
                            ok = all(c.post(url, json=body(m)).status_code == 200 for url, m in probes)
                        if ok:
                            break
                    except (httpx.HTTPError, ValueError, KeyError):
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"target {t.name} not ready after {timeout_s:.0f} s")
                    time.sleep(0.25)

    # ---------------------------------------------------------------- per-trial helpers

    async def flush(self, client: httpx.AsyncClient, timeout_s: float = 30.0) -> None:
        """POST /flush_cache on every worker (retried while requests still run)."""
        async def one(url: str) -> None:
            deadline = time.monotonic() + timeout_s
            while True:
                r = await client.post(url + "/flush_cache")
                if r.status_code == 200:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}: /flush_cache still refused after {timeout_s:.0f} s: {r.text[:80]}")
                await asyncio.sleep(0.1)

        await asyncio.gather(*(one(u) for u in self.worker_urls.values()))

    async def load_adapters(self, names: list[str], targets: list[Target], timeout_s: float = 60.0) -> None:
        """Load LoRA adapters `names` on every worker (SGLang's /load_lora_adapter), then wait until
        every kvroute target's /workers shows them on every worker (its probes read /v1/models)."""
        async with httpx.AsyncClient(timeout=10.0) as client:
            for url in self.worker_urls.values():
                for name in names:
                    r = await client.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": f"/lora/{name}"})
                    if r.status_code != 200:
                        raise RuntimeError(f"{url}: /load_lora_adapter {name}: {r.status_code} {r.text[:200]}")
            deadline = time.monotonic() + timeout_s
            for t in targets:
                while True:
                    view = await self.kvroute_workers(client, t)
                    if view is None or all(set(names) <= set(w.get("adapters", ())) for w in view):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{t.name}: adapters not discovered within {timeout_s:.0f} s")
                    await asyncio.sleep(0.5)

    async def poke(self, client: httpx.AsyncClient) -> None:
        """One tiny request straight to every worker (not through any router), after a flush: each
        worker runs a prefill batch and so emits a fresh KvMetrics report showing it empty. Without
        it, a metrics-driven router would start a trial believing the load the previous target left
        in the workers' last reports (SGLang stops reporting when idle; see `stale_view`)."""
        body = {"model": "default", "messages": [{"role": "user", "content": "poke"}], "max_tokens": 1}
        if self._pd_workers:  # PD sims take only pairs: each prefill sim with a decode sim, one room each
            pre = [n for n, (r, _) in self._pd_workers.items() if r == "prefill"]
            dec = [n for n, (r, _) in self._pd_workers.items() if r == "decode"]
            posts = []
            n = self.dp_size  # with DP ranks, every rank of every worker: the pair pinned to rank r on both
            for i in range(max(len(pre), len(dec)) * n):
                p, r = pre[(i // n) % len(pre)], i % n
                b = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self._pd_workers[p][1],
                     "bootstrap_room": random.getrandbits(62) * n + r}  # ≡ r: the prefill sim's rank
                d = {**b, "routed_dp_rank": r, "disagg_prefill_dp_rank": r} if n > 1 else b
                posts += [client.post(self.worker_urls[p] + "/v1/chat/completions", json=b),
                          client.post(self.worker_urls[dec[(i // n) % len(dec)]] + "/v1/chat/completions", json=d)]
            rs = await asyncio.gather(*posts)
        else:
            rs = await asyncio.gather(*(client.post(u + "/v1/chat/completions", json=body)
                                        for u in self.worker_urls.values()))
        bad = [r.status_code for r in rs if r.status_code != 200]
        if bad:
            raise RuntimeError(f"poke failed: {bad}")

    async def stale_view(self, client: httpx.AsyncClient, target: Target) -> list[dict[str, Any]] | None:
        """For a kvroute target: the workers its router believes busy (reported running or waiting
        requests, or KV in use) while the engine itself is idle — the view a trial would start from."""
        ws = await self.kvroute_workers(client, target)
        if ws is None:
            return None
        st = await self.stats(client)
        out = []
        for w in ws:
            m = w.get("metrics") or {}
            s = st.get(w["name"], {})
            busy_view = m.get("request_active_slots", 0) or m.get("num_requests_waiting", 0) or m.get("kv_active_blocks", 0)
            idle_engine = not s.get("num_running_reqs") and not s.get("num_waiting_reqs")
            if w["state"] == "live" and busy_view and idle_engine:
                out.append({"worker": w["name"], "state": w["state"], "metrics_age_s": w.get("metrics_age_s"),
                            "reported_running": m.get("request_active_slots"),
                            "reported_waiting": m.get("num_requests_waiting"),
                            "reported_kv_active": m.get("kv_active_blocks"),
                            "engine_running": s.get("num_running_reqs"), "engine_waiting": s.get("num_waiting_reqs")})
        return out

    async def stats(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        async def one(name: str, url: str) -> tuple[str, dict[str, Any]]:
            try:
                return name, (await client.get(url + "/sim/stats")).json()
            except httpx.RemoteProtocolError:  # a kept-alive connection the sim closed (uvicorn: 5 s idle) just then
                return name, (await client.get(url + "/sim/stats")).json()

        return dict(await asyncio.gather(*(one(n, u) for n, u in self.worker_urls.items())))

    async def kvroute_workers(self, client: httpx.AsyncClient, target: Target) -> list[dict[str, Any]] | None:
        if not target.name.startswith("kvroute-"):
            return None
        try:
            return (await client.get(target.urls[0] + "/workers")).json()["workers"]
        except Exception:
            return None

    def check_alive(self) -> None:
        for name, p in self._procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} died (status {p.returncode}); see {self.tmpdir}/{name}.log")

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        for name, p in self._procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self._procs.items():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        if self._runner is not None:
            try:
                self._runner.stop()  # worker actors (and their sims), serve.shutdown(), aggregator
            except Exception as exc:
                log.warning("fleet stop: %s", exc)
            self._runner = None
        try:
            import ray

            if self._ray_started and ray.is_initialized():
                ray.shutdown()
        except Exception as exc:
            log.warning("ray shutdown: %s", exc)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
