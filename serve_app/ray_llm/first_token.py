"""The first-token moment of a Serve LLM request, from the ingress to the request routers of its own
process (no Ray): Serve's handle API gives a request router no such moment, but the ingress sees it.

Ray's `OpenAiIngress` awaits a streamed reply's first chunk from the LLM replica before it returns
its `StreamingResponse` (`_peek_at_generator`); for SGLangServer that chunk carries the first token.
kvroute's ingress class (`serve_app.ray_llm.ingress.OpenAiIngress`) calls `first_token` with the
request's Serve `internal_request_id` right then — the id the deployment handle, and so the request
router inside it, saw the same request under (a handle call takes the caller's request context). The
routers that subscribed (every `KvRouteRequestRouter` of the process) release that request's prefill
charge in their ledger, as kvroute's own router replica does at the first streamed byte. Non-streamed
replies have no first-token moment before completion, which Serve reports anyway.
"""

from __future__ import annotations

import weakref
from typing import Protocol


class FirstTokenListener(Protocol):
    def on_first_token_signal(self, internal_request_id: str) -> None:
        """Called from the ingress's thread; must hand over to the listener's own loop."""


_listeners: "weakref.WeakSet[FirstTokenListener]" = weakref.WeakSet()


def subscribe(listener: FirstTokenListener) -> None:
    _listeners.add(listener)


def first_token(internal_request_id: str) -> int:
    """The request's first token has left its replica; returns how many routers were told."""
    listeners = list(_listeners)
    for listener in listeners:
        listener.on_first_token_signal(internal_request_id)
    return len(listeners)
