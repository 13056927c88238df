"""Pure pieces of the Serve request router (no Ray): a handle call's arguments → the request body
kvroute's facts are read from, a decision → Serve's ranks of replicas, and the reason label."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, TypeVar

from serve_app.policies.base import RouteRequest

R = TypeVar("R")

_PROMPT_KEYS = ("messages", "prompt", "text", "input_ids")
_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")


def _plain(x: Any) -> Any:
    """Pydantic models (OpenAI message objects) → plain dicts/lists, recursively."""
    if hasattr(x, "model_dump") and callable(x.model_dump):
        return x.model_dump(exclude_none=True)
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def request_body(args: Sequence[Any] | None) -> dict[str, Any] | None:
    """The OpenAI-shaped body of a handle call: the first argument that is a request model
    (Ray Serve LLM's `ChatCompletionRequest` / `CompletionRequest`: `.messages` / `.prompt`) or a
    dict with a prompt key. None if no argument carries a prompt (e.g. `/v1/models`)."""
    for arg in args or ():
        if isinstance(arg, Mapping):
            if any(k in arg for k in _PROMPT_KEYS):
                return dict(arg)
            continue
        for key in ("messages", "prompt"):
            value = getattr(arg, key, None)
            if value is not None:
                body: dict[str, Any] = {key: _plain(value)}
                for lim in _LIMIT_KEYS:
                    n = getattr(arg, lim, None)
                    if isinstance(n, int):
                        body[lim] = n
                return body
    return None


def reason_label(request: RouteRequest, worker: str) -> str:
    """A low-cardinality reason for metrics: `prefix` when the pick holds part of the prompt, else `load`."""
    return "prefix" if request.overlap.get(worker, 0) > 0 else "load"


def split_ranks(by_name: Mapping[str, R], chosen: str, known: set[str] | frozenset[str]) -> list[list[R]]:
    """Serve's ranks: kvroute's pick first, with the replicas kvroute has never heard of (Serve
    balances those by queue length), then every other known replica as the fallback rank."""
    first = [by_name[chosen]] + [r for n, r in by_name.items() if n not in known and n != chosen]
    rest = [r for n, r in by_name.items() if n in known and n != chosen]
    return [first, rest] if rest else [first]
