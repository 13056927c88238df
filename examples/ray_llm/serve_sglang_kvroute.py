"""Ray Serve LLM + SGLang with kvroute as the request router (Ray's own example, two lines changed).

Ray's `ray/llm/examples/sglang/serve_sglang_example.py`, with kvroute's `server_cls` (sends each
replica's KvMetrics to kvroute's metrics plane) and kvroute's request router (ranks replicas by
kv_aware over those metrics, its in-flight ledger and prefix index). Needs GPUs and
`pip install kvroute "sglang[all,ray]"`.

    cd examples/ray_llm && RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=0 serve run serve_sglang_kvroute:app

Without a GPU, `SIM=1` runs the same app over kvroute's simulated SGLang engine. `EXACT=1` turns on
exact prefix mode: the engines publish their KV events to per-replica KV logs and the router, which
tokenizes prompts like the engine (`tokenizer`: the model's tokenizer directory, or `sim`), follows
them (docs/ray-serve-llm.md). With a real model the directory must hold its tokenizer.json and chat
template on the ingress replicas' nodes (`MODEL_DIR`).
"""

import os

from ray.serve.llm import LLMConfig, build_openai_app

SIM = os.environ.get("SIM") == "1"
EXACT = os.environ.get("EXACT") == "1"
TOKENIZER = "sim" if SIM else f"hf:{os.environ.get('MODEL_DIR', '/models/Llama-3.1-8B-Instruct')}"

llm_config = LLMConfig(
    model_loading_config={
        "model_id": "Llama-3.1-8B-Instruct",
        "model_source": "unsloth/Llama-3.1-8B-Instruct",
    },
    deployment_config={
        "autoscaling_config": {"min_replicas": 2, "max_replicas": 4},
        # kvroute, line 1 of 2: the request router
        "request_router_config": {
            "request_router_class": "serve_app.ray_llm.request_router:KvRouteRequestRouter",
            "request_router_kwargs": {"policy": "kv_aware",
                                      # exact prefix mode: tokenize like the engine, blocks = its pages
                                      **({"tokenizer": TOKENIZER, "router": {"block_size": 16}} if EXACT else {})},
        },
    },
    # exact prefix mode, the server side: the engine publishes KV events to the replica's KV log
    experimental_configs={"kvroute": {"kv_events": True}} if EXACT else {},
    # kvroute, line 2 of 2: the server class (Ray's SGLangServer + kvroute's metrics plane)
    server_cls=("serve_app.ray_llm.server:SimSGLangServer" if SIM
                else "serve_app.ray_llm.server:KvrouteSGLangServer"),
    engine_kwargs=({"page_size": 16} if SIM else {
        "trust_remote_code": True,
        "model_path": "unsloth/Llama-3.1-8B-Instruct",
        "tp_size": 1,
        "mem_fraction_static": 0.8,
        "page_size": 16,
    }),
)

app = build_openai_app({
    "llm_configs": [llm_config],
    # Ray's OpenAiIngress with route signatures that survive FastAPI >= 0.137 (ray-project/ray#64475), and
    # which tells kvroute's router each streamed reply's first token (its prefill charge ends there)
    "ingress_cls_config": {"ingress_cls": "serve_app.ray_llm.ingress:OpenAiIngress"},
})
