"""Ray Serve LLM's `OpenAiIngress`, unchanged but for one thing: its routes keep working on FastAPI
≥ 0.137 (ray-project/ray#64475).

Serve turns an ingress's methods into FastAPI routes by giving their `self` a `Depends(...)` default
(`__signature__`), in the process that builds the app. FastAPI ≥ 0.137 resolves included routes
lazily, at request time, in the replica — where the methods were unpickled by reference, without
that signature — so every request fails with 400 "Field required at ('query', 'self')". Here each
endpoint is a thin wrapper around Ray's own method whose signature is fixed when this module is
imported, which the replica does when it unpickles the class. Name it in `build_openai_app`:
`{"ingress_cls_config": {"ingress_cls": "serve_app.ray_llm.ingress:OpenAiIngress"}}`; with
FastAPI < 0.137 Ray's own class works as is.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from fastapi import Depends
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress as _RayOpenAiIngress


async def _servable() -> Any:
    """The replica's ingress instance (what Serve's own class-based view injects as `self`)."""
    from ray import serve

    return serve.get_replica_context().servable_object


class OpenAiIngress(_RayOpenAiIngress):
    """`OpenAiIngress` whose route signatures survive pickling (see the module docstring)."""


def _endpoint(name: str) -> Any:
    base = getattr(_RayOpenAiIngress, name)

    @functools.wraps(base)
    async def endpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await base(self, *args, **kwargs)

    endpoint.__module__ = __name__  # pickled by reference to *this* class's attribute
    endpoint.__qualname__ = f"{OpenAiIngress.__qualname__}.{name}"
    del endpoint.__wrapped__  # FastAPI must read our signature, not the wrapped one's
    sig = inspect.signature(base, eval_str=True)
    params = list(sig.parameters.values())
    endpoint.__signature__ = sig.replace(parameters=[
        params[0].replace(default=Depends(_servable)),
        *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[1:]),
    ])
    return endpoint


for _name in DEFAULT_ENDPOINTS:
    setattr(OpenAiIngress, _name, _endpoint(_name))
del _name
