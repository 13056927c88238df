"""A simulated SGLang server: engine model, HTTP surface, and metrics/KV events as SGLang emits them."""
