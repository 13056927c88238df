"""Ray Serve LLM apps with kvroute's pieces: the config a user writes (`llm_config`), and the same
over the simulated engine (`sim_llm_config`) for tests and `bench.run`. Needs Ray Serve LLM."""

from __future__ import annotations

from typing import Any

ROUTER_CLASS = "serve_app.ray_llm.request_router:KvRouteRequestRouter"
SERVER_CLASS = "serve_app.ray_llm.server:KvrouteSGLangServer"
SIM_SERVER_CLASS = "serve_app.ray_llm.server:SimSGLangServer"
PREFIX_ROUTER_CLASS = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
POW2_ROUTER_CLASS = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"

ROUTERS = {"kvroute": ROUTER_CLASS, "prefix": PREFIX_ROUTER_CLASS, "pow2": POW2_ROUTER_CLASS}


def llm_config(model_id: str, *, server_cls: str = SERVER_CLASS, router: str = "kvroute",
               router_kwargs: dict[str, Any] | None = None, engine_kwargs: dict[str, Any] | None = None,
               deployment_config: dict[str, Any] | None = None, **fields: Any) -> Any:
    """An `LLMConfig` whose deployment is routed by `router` (`kvroute`, `prefix`, `pow2`, or a class path)."""
    from ray.serve.llm import LLMConfig

    dep = dict(deployment_config or {})
    rrc: dict[str, Any] = {"request_router_class": ROUTERS.get(router, router)}
    if router_kwargs:
        rrc["request_router_kwargs"] = router_kwargs
    dep["request_router_config"] = rrc
    return LLMConfig(model_loading_config={"model_id": model_id}, server_cls=server_cls,
                     engine_kwargs=dict(engine_kwargs or {}), deployment_config=dep, **fields)


def sim_llm_config(model_id: str = "sim-model", *, num_replicas: int = 2, router: str = "kvroute",
                   router_kwargs: dict[str, Any] | None = None, max_ongoing_requests: int = 256,
                   engine: dict[str, Any] | None = None, kv_events: bool = False) -> Any:
    """`llm_config` over `SimSGLangServer`: `num_replicas` simulated SGLang engines (page 16 unless set);
    `kv_events`: the engines publish KV events to their replicas' KV logs (exact prefix mode — give
    the router `{"tokenizer": "sim"}` too)."""
    return llm_config(
        model_id, server_cls=SIM_SERVER_CLASS, router=router, router_kwargs=router_kwargs,
        engine_kwargs={"page_size": 16, **(engine or {})},
        deployment_config={"num_replicas": num_replicas, "max_ongoing_requests": max_ongoing_requests,
                           "ray_actor_options": {"num_cpus": 0}},
        log_engine_metrics=False, **({"experimental_configs": {"kvroute": {"kv_events": True}}} if kv_events else {}))


INGRESS_CLASS = "serve_app.ray_llm.ingress:OpenAiIngress"


def openai_app(*configs: Any) -> Any:
    """Ray Serve LLM's own OpenAI app (`build_openai_app`: `OpenAiIngress` → handles → replicas), with
    the ingress whose routes survive FastAPI ≥ 0.137 (`serve_app.ray_llm.ingress`)."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": list(configs),
                             "ingress_cls_config": {"ingress_cls": INGRESS_CLASS},
                             "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})
