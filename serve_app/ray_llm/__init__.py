"""kvroute inside Ray Serve LLM: a Serve `RequestRouter` that ranks SGLang replicas with kvroute's
policies (`request_router`), a `server_cls` around Ray Serve LLM's `SGLangServer` that feeds each
replica's KvMetrics into kvroute's metrics plane (`server`, `collector`), and kvroute's figures
through `ray.util.metrics` (`ray_metrics`).

Modules are imported by path (`serve_app.ray_llm.request_router:KvRouteRequestRouter`): the
server side needs Ray Serve LLM (and its protocol models, from SGLang or vLLM), the router does not.
"""
