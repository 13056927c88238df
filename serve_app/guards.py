"""What every request passes before it is routed: header size, API keys, the body's size and JSON shape.

Each guard raises `HttpError` with the answer the client gets; none of them lets a request through
on an error.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from serve_app.config import RouterConfig
from serve_app.http import HttpError, Request


def _bearer_ok(request: Request, key: str) -> bool:
    """OpenAI-style `Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def check_client(request: Request, config: RouterConfig) -> None:
    """Every route but /healthz: the header block's size, then the API key."""
    size = request.header_bytes()
    if size > config.max_header_bytes:
        raise HttpError(431, f"request headers total {size} bytes, above the limit of {config.max_header_bytes}",
                        code="headers_too_large")
    if config.api_key and not _bearer_ok(request, config.api_key):
        raise HttpError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")


def check_admin(request: Request, config: RouterConfig) -> None:
    """Fleet changes: only with an admin key configured, and only with that key."""
    if not config.admin_key:
        raise HttpError(403, "fleet changes are disabled: set router admin_key (env KVROUTE_ADMIN_KEY)",
                        code="admin_disabled")
    if not _bearer_ok(request, config.admin_key):
        raise HttpError(401, "missing or invalid admin key (Authorization: Bearer <admin key>)",
                        code="invalid_admin_key")


async def json_body(request: Request, config: RouterConfig) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded unchanged) and its JSON object."""
    raw = await request.body(config.max_body_bytes)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise HttpError(400, "body JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object", code="invalid_body")
    return raw, body
