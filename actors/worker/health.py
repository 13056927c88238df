"""One worker's liveness as its actor sees it: a fast HTTP liveness probe when due (passive while its
KvMetrics frames arrive), SGLang's slow `/health` as confirmation, and (attach mode) the model list
from `GET /v1/models`. No Ray import."""

from __future__ import annotations

import asyncio
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
    """The pooled HTTP client of a worker's probes (per-request timeouts: `HealthProbe._get`)."""
    return httpx.AsyncClient(timeout=settings.health_timeout_s,
                             limits=httpx.Limits(keepalive_expiry=_PROBE_KEEPALIVE_S))


class HealthProbe:
    """`healthy`/`detail` of worker `name`, the model names it serves (`models`: as declared, else —
    `discover` — what its /v1/models lists) and the LoRA adapters it has loaded (`adapters`: its
    /v1/models entries with a `parent`, SGLang's form — read at every liveness probe, so an adapter
    loaded or unloaded at run time is seen within a probe interval). `on_change()` is called when
    liveness, the model list or the adapters change (the caller pushes a report at once).

    Two signals, because SGLang's `/health` is slow by design (it waits ≥ 1 s for a one-token
    generation to come back through the scheduler, and says 503 only after its own 20 s):
    - the *liveness probe* (`probe()`, when `due()`): `GET /v1/models`, answered by SGLang's HTTP
      process at once — a dead server refuses it (down at once), a hung one times out
      (`health_timeouts_before_down` in a row), and its body keeps the model list fresh;
    - the *confirmation*: `GET /health` every `health_check_interval_s`, in the background so that
      it never delays a liveness probe, with `health_check_timeout_s`. A worker is healthy only once
      a confirmation has said 200 (a server still starting answers /v1/models but 503s /health):
      until then each liveness probe that is answered awaits one. A 503 later marks it down until
      a confirmation says 200 again.
    """

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
        self.probed_at = float("-inf")  # when the last liveness probe started (time.monotonic)
        self.probes = 0
        self.confirmed: bool | None = None  # the last /health verdict (None: none yet)
        self._confirm_at = float("-inf")  # when the last confirmation started
        self._confirming: asyncio.Task | None = None
        self.confirmations = 0
        self._reachable = False  # the last liveness probe was answered 200

    def due(self, heard_at: float | None) -> float:
        """When the next liveness probe is due (time.monotonic), given when the worker's newest
        KvMetrics frame arrived. Frames prove its scheduler alive: while one arrived within
        `health_interval_s`, a healthy worker is probed every `health_busy_interval_s`; silent —
        idle, or gone — or failing (unhealthy, a probe timed out), every `health_interval_s`, so a
        dead worker is probed at most that long after its last frame."""
        s = self.settings
        active = self.probed_at + s.health_interval_s
        if heard_at is None or not self.healthy or self._timeouts:
            return active
        return max(active, min(heard_at + s.health_interval_s, self.probed_at + s.health_busy_interval_s))

    def set(self, healthy: bool, detail: str) -> None:
        if healthy != self.healthy:
            logger.info("worker %s: %s (%s)", self.name, "healthy" if healthy else "UNHEALTHY", detail)
            self._on_change()  # liveness changes are pushed at once, not at the next heartbeat
        self.healthy, self.detail = healthy, detail

    async def probe(self, url: str | None) -> None:
        """One liveness probe of `url` (and a confirmation started when one is due)."""
        self.probed_at = time.monotonic()
        self.probes += 1
        if not url:
            self.set(False, "no url yet")
            return
        try:
            r = await self._get(url, "/v1/models", self.settings.health_timeout_s)
        except httpx.TimeoutException:
            self._timeouts += 1
            if self._timeouts >= self.settings.health_timeouts_before_down:
                self._reachable = False
                self.set(False, f"/v1/models timed out {self._timeouts}x")
            return
        except httpx.HTTPError as exc:
            self._timeouts, self._reachable = 0, False
            self.set(False, f"unreachable: {type(exc).__name__}")
            return
        self._timeouts = 0
        self._reachable = r.status_code == 200
        if not self._reachable:
            self.set(False, f"/v1/models returned {r.status_code}")
            return
        self._take_models(r)
        if self.confirmed:
            self._confirm_soon(url)  # in the background: it takes ≥ 1 s on SGLang
            self.set(True, "ok")
        else:  # not routable anyway: nothing for the confirmation to hold up
            await self._confirm(url)

    def close(self) -> None:
        if self._confirming is not None:
            self._confirming.cancel()

    # --- the confirmation -----------------------------------------------------------------------

    def _confirm_soon(self, url: str) -> None:
        """A background confirmation if `health_check_interval_s` has passed since the last one."""
        if self._confirming is not None and not self._confirming.done():
            return
        if time.monotonic() - self._confirm_at < self.settings.health_check_interval_s:
            return
        self._confirming = asyncio.get_running_loop().create_task(self._confirm(url))

    async def _confirm(self, url: str) -> None:
        """GET /health; its verdict decides `healthy` together with the last liveness probe."""
        self._confirm_at = time.monotonic()
        self.confirmations += 1
        try:
            code = (await self._get(url, "/health", self.settings.health_check_timeout_s)).status_code
        except asyncio.CancelledError:
            raise
        except httpx.TimeoutException:
            verdict, detail = False, f"/health timed out after {self.settings.health_check_timeout_s:g} s"
        except httpx.HTTPError as exc:
            verdict, detail = False, f"/health unreachable: {type(exc).__name__}"
        else:
            verdict, detail = code == 200, "" if code == 200 else f"/health returned {code}"
        self.confirmed = verdict
        if not verdict:
            self.set(False, detail)
        elif self._reachable:
            self.set(True, "ok")

    # --- HTTP -----------------------------------------------------------------------------------

    async def _get(self, url: str, path: str, timeout_s: float) -> httpx.Response:
        """GET `url``path`. A connection error is asked once more on a fresh connection before it
        counts: a pooled connection the worker closed as it was reused (a keep-alive shorter than the
        client's) fails like a dead worker, and a dead worker refuses the second one as fast."""
        try:
            return await self._http.get(f"{url}{path}", timeout=timeout_s)
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as exc:
            logger.debug("worker %s: %s %s, asking once more", self.name, path, type(exc).__name__)
        return await self._http.get(f"{url}{path}", timeout=timeout_s)

    def _take_models(self, r: httpx.Response) -> None:
        """What the worker's `GET /v1/models` lists: its LoRA adapters (entries with a `parent`, as
        SGLang lists each loaded adapter) and — attach mode without `served_model_names` — its model
        names (the other entries). A body not understood changes nothing."""
        try:
            data = r.json()["data"]
            entries = [(m["id"], m.get("parent"), m.get("root")) for m in data] if isinstance(data, list) else None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.debug("worker %s: /v1/models body not understood (%s)", self.name, type(exc).__name__)
            return
        if entries is None or not all(isinstance(i, str) and 0 < len(i) <= 256 for i, _, _ in entries):
            logger.debug("worker %s: /v1/models gave no usable model list", self.name)
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
        models = list(dict.fromkeys(i for i, parent, _ in entries if not parent))[:64]
        if self._discover and models and models != self.models:
            self.models = models
            logger.info("worker %s serves %s (its /v1/models)", self.name, ", ".join(self.models))
            changed = True
        if changed:
            self._on_change()
