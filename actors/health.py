"""One worker's liveness as its hosting process sees it: the HTTP /health probe, when it is due
(passive liveness: a worker whose KvMetrics frames keep arriving is alive, so it is probed only
slowly), (attach mode) model discovery and (every mode) its LoRA adapters through `GET /v1/models`. Shared by the per-worker actor
and the node's host (a metrics host, or the aggregator for its own node). No Ray import."""

from __future__ import annotations

import logging
import time
from typing import Callable

import httpx

from actors.models import Settings
from actors.protocol import Adapter

logger = logging.getLogger("kvroute.worker")

# A pooled probe connection idle this long is not reused. SGLang's server (uvicorn, as the sim's) closes
# idle keep-alive connections after 5 s (SGLANG_TIMEOUT_KEEP_ALIVE), and a busy worker is probed every
# `health_busy_interval_s` (5 s): with httpx's own 5 s expiry the probe was sent on a connection the
# server was closing at that moment — "Server disconnected" — and the worker was marked down for a
# probe interval while it served (2.5 % of busy probes under the pd suite's load; with 4 s, none).
_PROBE_KEEPALIVE_S = 4.0


def probe_client(settings: Settings) -> httpx.AsyncClient:
    """The pooled HTTP client of a host's /health probes (and attach-mode model discovery)."""
    return httpx.AsyncClient(timeout=settings.health_timeout_s,
                             limits=httpx.Limits(keepalive_expiry=_PROBE_KEEPALIVE_S))


class HealthProbe:
    """`healthy`/`detail` of worker `name`, the model names it serves (`models`: as declared,
    else — `discover` — what its /v1/models lists once healthy) and the LoRA adapters it has loaded
    (`adapters`: its /v1/models entries with a `parent`, SGLang's form, asked again at every probe
    that finds it healthy, so an adapter loaded or unloaded at run time is seen within a probe
    interval). `on_change()` is called when liveness, the model list or the adapters change (the
    caller pushes a report at once)."""

    def __init__(self, name: str, settings: Settings, http: httpx.AsyncClient, on_change: Callable[[], None], *,
                 models: list[str], discover: bool) -> None:
        self.name = name
        self.settings = settings
        self._http = http
        self._on_change = on_change
        self.models = list(models)
        self.adapters: list[Adapter] = []
        self._discover = discover
        self.healthy = False
        self.detail = "not probed yet"
        self._timeouts = 0
        self.probed_at = float("-inf")  # when the last probe started (time.monotonic)
        self.probes = 0

    def due(self, heard_at: float | None) -> float:
        """When the next probe is due (time.monotonic), given when the worker's newest KvMetrics frame
        arrived. Frames prove its scheduler alive: while one arrived within `health_interval_s`, a
        healthy worker is probed every `health_busy_interval_s` (an HTTP server can hang while the
        scheduler publishes); silent — idle, or gone — or failing (unhealthy, a probe timed out),
        every `health_interval_s`, so a dead worker is probed at most that long after its last frame."""
        s = self.settings
        active = self.probed_at + s.health_interval_s
        if heard_at is None or not self.healthy or self._timeouts or (self._discover and not self.models):
            return active  # (a model list still to discover is asked at each probe)
        return max(active, min(heard_at + s.health_interval_s, self.probed_at + s.health_busy_interval_s))

    def set(self, healthy: bool, detail: str) -> None:
        if healthy != self.healthy:
            logger.info("worker %s: %s (%s)", self.name, "healthy" if healthy else "UNHEALTHY", detail)
            self._on_change()  # liveness changes are pushed at once, not at the next heartbeat
        self.healthy, self.detail = healthy, detail

    async def probe(self, url: str | None) -> None:
        """One GET `url`/health: 200 → healthy; refused or another status → unhealthy at once;
        `health_timeouts_before_down` consecutive timeouts → unhealthy."""
        self.probed_at = time.monotonic()
        self.probes += 1
        if not url:
            self.set(False, "no url yet")
            return
        try:
            code = await self._get_health(url)
        except httpx.TimeoutException:
            self._timeouts += 1
            if self._timeouts >= self.settings.health_timeouts_before_down:
                self.set(False, f"/health timed out {self._timeouts}x")
            return
        except httpx.HTTPError as exc:
            self._timeouts = 0
            self.set(False, f"/health unreachable: {type(exc).__name__}")
            return
        self._timeouts = 0
        if code == 200:
            # asked before it is reported healthy: a report in between (the actor pushes one as
            # soon as it is woken) would show a healthy worker with no model — a candidate for
            # every model's requests until its list arrived — or without its adapters
            await self._ask_models(url)
            self.set(True, "ok")
        else:
            self.set(False, f"/health returned {code}")

    async def _get_health(self, url: str) -> int:
        """GET /health's status. A connection error is asked once more on a fresh connection before it
        counts: a pooled connection the worker closed as it was reused (a keep-alive shorter than the
        client's) fails like a dead worker, and a dead worker refuses the second one as fast."""
        try:
            return (await self._http.get(f"{url}/health")).status_code
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as exc:
            logger.debug("worker %s: /health %s, asking once more", self.name, type(exc).__name__)
        return (await self._http.get(f"{url}/health")).status_code

    async def _ask_models(self, url: str) -> None:
        """What the worker's `GET /v1/models` lists: its LoRA adapters (entries with a `parent`, as
        SGLang lists each loaded adapter), and — attach mode without `served_model_names` — its model
        names (the other entries; asked at each probe until it answers, until then the worker
        reports no model). A failed answer changes nothing."""
        try:
            r = await self._http.get(f"{url}/v1/models")
            data = r.json()["data"] if r.status_code == 200 else None
            entries = [(m["id"], m.get("parent"), m.get("root")) for m in data] if isinstance(data, list) else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.debug("worker %s: /v1/models not answered (%s)", self.name, type(exc).__name__)
            return
        ok = entries is not None and all(isinstance(i, str) and 0 < len(i) <= 256 for i, _, _ in entries)
        if not ok:
            logger.debug("worker %s: /v1/models gave no usable model list (HTTP %s)", self.name, r.status_code)
            return
        changed = False
        seen: dict[str, Adapter] = {}
        for i, parent, root in entries:
            if parent and i not in seen:
                seen[i] = Adapter(i, root[:4096] if isinstance(root, str) else "")
        adapters = list(seen.values())[:1024]
        if adapters != self.adapters:
            logger.info("worker %s: LoRA adapters %s (its /v1/models)", self.name,
                        ", ".join(a.name for a in adapters) or "none")
            self.adapters, changed = adapters, True
        ids = [i for i, parent, _ in entries if not parent]
        if ids and self._discover and not self.models:
            self.models = list(dict.fromkeys(ids))[:64]
            logger.info("worker %s serves %s (its /v1/models)", self.name, ", ".join(self.models))
            changed = True
        if changed:
            self._on_change()
