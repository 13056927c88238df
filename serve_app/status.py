"""The worker table (rich): printed once by `kvroute status`, refreshed live by `kvroute demo`."""

from __future__ import annotations

import sys
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

_STATE_STYLE = {"live": "green", "idle": "cyan", "down": "bold red"}


def fetch_workers(url: str, api_key: str | None = None, timeout_s: float = 3.0) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url.rstrip('/')}/workers", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def render(data: dict[str, Any]) -> Table:
    t = Table(title=f"kvroute workers (snapshot v{data.get('version')})", expand=False)
    with_models = any(w.get("models") for w in data.get("workers", []))  # a column only when workers name them
    with_roles = any(w.get("role", "both") != "both" for w in data.get("workers", []))  # PD fleets (docs/pd.md)
    for col in ("worker", *(("model",) if with_models else ()), *(("role",) if with_roles else ()), "state",
                "run/slots", "wait", "KV", "hit", "in-flt", "age"):
        t.add_column(col, justify="right" if col not in ("worker", "model", "role", "state") else "left", no_wrap=True)
    for w in data.get("workers", []):
        m = w.get("metrics") or {}
        total = m.get("request_total_slots")
        running = f"{m.get('request_active_slots', 0)}/{total}" if m else "-"
        kv = f"{100 * m['gpu_cache_usage_perc']:.1f}%" if m else "-"
        hit = f"{100 * m['gpu_prefix_cache_hit_rate']:.0f}%" if m else "-"
        age = w.get("metrics_age_s")
        t.add_row(
            w["name"],
            *((", ".join(w.get("models") or []) or "?",) if with_models else ()),
            *((w.get("role", "both") + (f" :{w['bootstrap_port']}" if w.get("bootstrap_port") else ""),)
              if with_roles else ()),
            f"[{_STATE_STYLE.get(w['state'], '')}]{w['state']}[/]",
            running,
            str(m.get("num_requests_waiting", "-")) if m else "-",
            kv,
            hit,
            str(w.get("in_flight", 0)),
            "never" if age is None else f"{age:.1f}s",
        )
    return t


def print_status(url: str, api_key: str | None = None) -> int:
    console = Console()
    try:
        data = fetch_workers(url, api_key)
    except httpx.HTTPStatusError as exc:
        console.print(f"[red]kvroute status: {url} answered {exc.response.status_code}[/]")
        return 1
    except httpx.HTTPError as exc:
        console.print(f"[red]kvroute status: cannot reach {url}: {type(exc).__name__}[/]")
        return 1
    console.print(render(data))
    return 0


class LiveTable:
    """Redraws the table each `tick()`; silent when the router is momentarily unreachable."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self._live: Live | None = None
        self._enabled = sys.stdout.isatty()

    def tick(self) -> None:
        try:
            data = fetch_workers(self.url, self.api_key, timeout_s=1.0)
        except httpx.HTTPError:
            return
        table = render(data)
        if not self._enabled:
            return
        if self._live is None:
            self._live = Live(table, refresh_per_second=2, transient=False)
            self._live.start()
        else:
            self._live.update(table)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
