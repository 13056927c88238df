"""`server_cls` for Ray Serve LLM: Ray's `SGLangServer` whose engine sends its KvMetrics to kvroute.

`KvrouteSGLangServer` (the one users name in `LLMConfig(server_cls=...)`) does, before the
in-process `sglang.Engine` starts: fix the scheduler's metrics ipc address (SGLang picks a random
one in `PortArgs.init_new` and never says which — the same fix as `actors.sglang_launch`, applied
in the replica process, where `Engine._launch_subprocesses` calls it), turn on what SGLang needs to
send KvMetrics (`enable_metrics`, and a `kv_events_config`: SGLang ≥ 0.5.3 sends KvMetrics only
with one), and register the replica with kvroute's metrics plane under its Serve replica id
(`names.replica_worker_name`) through an in-replica collector (`collector.ReplicaCollector`), which
leaves the fleet when the replica stops. With `kv_events: true` (exact prefix mode) it also starts
the replica's KV-log actor (`kv_log_actor.ReplicaKvLog`, on this node, owned by the replica), points
the engine's `kv_events_config` at the loopback port that actor bound, and names the actor in the
replica's worker record, so request routers follow what the engine really caches.

`SimSGLangServer` is the same class with the engine swapped for kvroute's simulator
(`sim_engine.SimSGLangEngine`): everything above the engine is Ray's code, no GPU needed.

Options go in `LLMConfig.experimental_configs["kvroute"]` (`KvrouteServerOptions`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any, AsyncGenerator

from ray import serve
from ray.llm._internal.serve.engines.sglang.sglang_engine import SGLangServer

from actors.models import Settings
from serve_app.ray_llm.collector import ReplicaCollector, default_metrics_endpoint
from serve_app.ray_llm.engine_config import KvrouteServerOptions, options_of, sglang_metrics_kwargs
from serve_app.ray_llm.names import ROUTING_STATS_KEY, worker_name
from serve_app.ray_llm.ray_metrics import ReplicaExporter

logger = logging.getLogger("kvroute.ray_llm.server")

def _replica_identity() -> tuple[str, str, str]:
    """(app, deployment, unique id) of the running Serve replica. Raises outside a replica."""
    rid = serve.get_replica_context().replica_id
    return rid.deployment_id.app_name or "", rid.deployment_id.name, rid.unique_id


def patch_port_args(endpoint: str) -> None:
    """Make SGLang's `PortArgs.init_new` (in this process) return `endpoint` as `metrics_ipc_name`."""
    from actors.sglang_launch import _patch_port_args  # the managed-engine fix, same code

    _patch_port_args(endpoint)


class KvrouteSGLangServer(SGLangServer):
    """`SGLangServer` + kvroute's metrics plane (see the module docstring)."""

    def __init__(self, llm_config: Any) -> None:
        opts = options_of(llm_config)
        if opts.kv_events:  # refused before anything starts (one publisher per engine)
            sglang_metrics_kwargs(llm_config.engine_kwargs, {})
        app, deployment, unique_id = _replica_identity()
        self.kvroute_worker = worker_name(app, deployment, unique_id)
        endpoint = opts.metrics_endpoint or default_metrics_endpoint(unique_id)
        page_size = int(llm_config.engine_kwargs.get("page_size") or 1)
        # bind first: SGLang's scheduler connects its PUSH to this address as it starts
        self._kvroute_collector = ReplicaCollector(
            self.kvroute_worker, endpoint, settings=Settings.model_validate(opts.settings), page_size=page_size,
            health=self._kvroute_health, url=f"serve://{app}/{deployment}/{unique_id}")  # no HTTP: names the replica
        self._kvroute_kv_log: Any = None
        try:
            kv_cfg = self._start_kv_log(opts, llm_config) if opts.kv_events else None
            self._start_engine(llm_config, endpoint, kv_cfg)
        except BaseException:
            asyncio.get_running_loop().create_task(self._kvroute_stop())
            raise
        self._kvroute_metrics = ReplicaExporter(self.kvroute_worker)
        self._kvroute_export = asyncio.get_running_loop().create_task(self._export_loop())
        logger.info("worker %s: engine up, KvMetrics on %s", self.kvroute_worker, endpoint)

    async def _export_loop(self) -> None:
        while True:
            try:
                self._kvroute_metrics.export_frames(self._kvroute_collector.book)
            except Exception:  # metrics must never touch serving
                logger.exception("worker %s: metrics export failed", self.kvroute_worker)
            await asyncio.sleep(1.0)

    async def _timed(self, gen: AsyncGenerator[Any, None], stream: bool) -> AsyncGenerator[Any, None]:
        t0 = time.perf_counter()
        first = stream
        async for item in gen:
            if first:
                first = False
                self._kvroute_metrics.observe_ttft(time.perf_counter() - t0)
            yield item

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        async for item in self._timed(super().chat(request, raw_request_info), bool(request.stream)):
            yield item

    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        async for item in self._timed(super().completions(request, raw_request_info), bool(request.stream)):
            yield item

    def _start_kv_log(self, opts: KvrouteServerOptions, llm_config: Any) -> dict[str, Any]:
        """Exact mode: start the replica's KV-log actor and return the engine's `kv_events_config`."""
        import ray

        from serve_app.ray_llm.kv_log_actor import kv_log_actor_name, start_kv_log_actor

        ranks = int(llm_config.engine_kwargs.get("dp_size") or 1)
        self._kvroute_kv_log = start_kv_log_actor(self.kvroute_worker, Settings.model_validate(opts.settings), ranks)
        # blocking like the engine start below (SGLangServer.__init__ is synchronous): a few seconds, once
        cfg = ray.get(self._kvroute_kv_log.kv_events_config.remote(), timeout=120)
        self._kvroute_collector.follow_kv_log(kv_log_actor_name(self.kvroute_worker), self._kvroute_kv_log)
        return cfg

    def _start_engine(self, llm_config: Any, endpoint: str, kv_events_config: dict[str, Any] | None) -> None:
        """Start the engine whose scheduler sends KvMetrics to `endpoint` and (exact mode) KV events
        as `kv_events_config` says (sets `self.engine`)."""
        patch_port_args(endpoint)
        llm_config.engine_kwargs = sglang_metrics_kwargs(llm_config.engine_kwargs, kv_events_config)
        SGLangServer.__init__(self, llm_config)

    def _kvroute_health(self) -> tuple[bool, str]:
        return True, "ok"

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats: the worker name this replica reports under (the router also derives it)."""
        return {ROUTING_STATS_KEY: self.kvroute_worker}

    async def kvroute_stats(self) -> dict[str, Any]:
        """The collector's counters (frames received/refused, pushes, latest values)."""
        return self._kvroute_collector.stats()

    async def __del__(self) -> None:
        """Serve's graceful stop: leave kvroute's fleet at once (a crash is noticed by heartbeat)."""
        task = getattr(self, "_kvroute_export", None)
        if task is not None:
            task.cancel()
        await self._kvroute_stop()

    async def _kvroute_stop(self) -> None:
        collector = getattr(self, "_kvroute_collector", None)
        if collector is not None:
            await collector.stop()
        kv_log = getattr(self, "_kvroute_kv_log", None)
        if kv_log is not None:
            from serve_app.ray_llm.kv_log_actor import stop_kv_log_actor

            self._kvroute_kv_log = None
            await stop_kv_log_actor(kv_log)


class SimSGLangServer(KvrouteSGLangServer):
    """`KvrouteSGLangServer` over the simulated engine. `engine_kwargs` are `SimSGLangEngine`'s
    (`time_scale`, `wire` and `sim.config.EngineConfig` fields such as `page_size`)."""

    def _start_engine(self, llm_config: Any, endpoint: str, kv_events_config: dict[str, Any] | None) -> None:
        from serve_app.ray_llm.sim_engine import SimSGLangEngine

        # what SGLangServer.__init__ sets, without importing sglang's RayEngine
        self._llm_config = llm_config
        self.engine_kwargs = llm_config.engine_kwargs
        self._is_paused = False
        self._sleeping_tags = set()
        kwargs = dict(self.engine_kwargs)
        if kv_events_config is not None:  # the same refusal and JSON as for SGLang's engine
            kwargs["kv_events_config"] = sglang_metrics_kwargs(kwargs, kv_events_config)["kv_events_config"]
        self.engine = SimSGLangEngine(metrics_ipc_name=endpoint, rid_prefix=f"{self.kvroute_worker}|", **kwargs)

    @classmethod
    def get_deployment_options(cls, llm_config: Any) -> dict[str, Any]:
        """No GPU bundle: the simulator needs none (SGLangServer's asks for tp × pp GPUs)."""
        opts = copy.deepcopy(llm_config.deployment_config)
        opts.setdefault("ray_actor_options", {}).setdefault("num_cpus", 0)
        return opts

    def _kvroute_health(self) -> tuple[bool, str]:
        engine = getattr(self, "engine", None)
        if engine is None:
            return False, "engine not started"
        return (True, "ok") if engine.alive else (False, f"simulated engine stopped: {engine.driver.failed!r}")

    async def check_health(self) -> None:
        ok, detail = self._kvroute_health()
        if not ok:
            raise RuntimeError(detail)

    async def __del__(self) -> None:
        await super().__del__()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
