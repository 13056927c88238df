"""Router settings given on a benchmark's command line: `SECTION.KEY=JSON` → a nested dict of
`RouterConfig` fields (`--router prefix_index.cache_share=0`, `--router admission.enabled=false`);
the same syntax, flat, for the metrics plane's `Settings` (`--settings coalesce_s=0.1`).
Values are JSON (numbers, true/false, strings in quotes); the result is validated where the
router is built, so a misspelt key fails there with pydantic's message."""

from __future__ import annotations

import json
from typing import Any


def parse_router_overrides(items: list[str], flag: str = "--router") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        path, sep, value = item.partition("=")
        if not sep or not path:
            raise SystemExit(f"{flag} {item!r}: expected SECTION.KEY=VALUE")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{flag} {item!r}: the value is not JSON ({exc.msg}); quote strings") from None
        *sections, key = path.split(".")
        node = out
        for sec in sections:
            node = node.setdefault(sec, {})
            if not isinstance(node, dict):
                raise SystemExit(f"{flag} {item!r}: {sec} is set both as a value and as a section")
        node[key] = parsed
    return out
