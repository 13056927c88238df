"""Ray Serve LLM's `OpenAiIngress`, unchanged but for two things: its routes keep working on FastAPI
≥ 0.137 (ray-project/ray#64475), and it reports first tokens to kvroute's request routers.

Serve turns an ingress's methods into FastAPI routes by giving their `self` a `Depends(...)` default
(`__signature__`), in the process that builds the app. FastAPI ≥ 0.137 resolves included routes
lazily, at request time, in the replica — where the methods were unpickled by reference, without
that signature — so every request fails with 400 "Field required at ('query', 'self')". Here each
endpoint is a thin wrapper around Ray's own method whose signature is fixed when this module is
imported, which the replica does when it unpickles the class. The same wrapper tells the request
routers of its process when a streamed reply's first token arrived (`serve_app.ray_llm.first_token`).
Name it in `build_openai_app`: `{"ingress_cls_config": {"ingress_cls":
"serve_app.ray_llm.ingress:OpenAiIngress"}}`; with FastAPI < 0.137 Ray's own class routes as is
(without the first-token signal).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from fastapi import Depends
from fastapi.responses import StreamingResponse
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress as _RayOpenAiIngress

from serve_app.ray_llm.first_token import first_token


def _internal_request_id() -> str:
    """Serve's id of the request being handled (the one its handle calls, and so the routers, see)."""
    from ray.serve.context import _get_serve_request_context

    return _get_serve_request_context()._internal_request_id


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
        rid = _internal_request_id()
        result = await base(self, *args, **kwargs)
        if rid and isinstance(result, StreamingResponse):  # returned once the first chunk arrived
            first_token(rid)
        return result

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
