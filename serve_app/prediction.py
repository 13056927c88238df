"""The router checking its own predictions: predicted prefix reuse per request vs the engine's `cached_tokens`.

For every answered request the router knows what it predicted the chosen worker would reuse (its
overlap, in blocks → tokens) and the engine says what it reused
(`usage.prompt_tokens_details.cached_tokens`, SGLang's own count; `serve_app.usage` reads it).
`PredictionCheck` keeps both per worker — cumulative totals for Prometheus and `/workers`, and a
window of the last requests — and judges the window: predicted reuse that the engine keeps not
finding (the router's blocks are not the engine's: tokenizer or chat template, page size, or the
engine's cache was flushed or restarted), or reuse the engine finds that the router never
predicted (affinity is blind: the index lost its state, or other clients fill that cache). Pure:
no I/O, no clock of its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PredictionCheckConfig:
    """When a worker's predictions count as diverging (`router.prediction_check`)."""

    window: int = 64
    """Requests per worker the judgement looks at (the newest)."""
    min_tokens: int = 2048
    """Judge only once the window's larger side (predicted or engine-reported) holds this many tokens."""
    ratio: float = 0.5
    """Diverging when one side of the window is below this share of the other."""
    warn_interval_s: float = 60.0
    """At most one warning per worker this often while it keeps diverging."""


@dataclass(slots=True)
class _Worker:
    predicted: int = 0  # tokens, since start
    cached: int = 0
    prompt: int = 0
    requests: int = 0
    window: deque[tuple[int, int]] = field(default_factory=deque)  # (predicted, cached) per request
    w_predicted: int = 0
    w_cached: int = 0
    warned_at: float = float("-inf")
    verdict: str = "ok"


class PredictionCheck:
    """Per worker: predicted vs engine-reported cached prompt tokens."""

    def __init__(self, config: PredictionCheckConfig = PredictionCheckConfig()) -> None:
        self.config = config
        self._workers: dict[str, _Worker] = {}

    def observe(self, worker: str, predicted: int, cached: int, prompt_tokens: int, now: float) -> str | None:
        """One answered request on `worker`: kvroute predicted `predicted` cached prompt tokens, the
        engine reported `cached` of its `prompt_tokens`. Returns a warning to log (naming the worker
        and the likely cause) when the window diverges and none was given within `warn_interval_s`."""
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        w.predicted += predicted
        w.cached += cached
        w.prompt += prompt_tokens
        w.requests += 1
        w.window.append((predicted, cached))
        w.w_predicted += predicted
        w.w_cached += cached
        if len(w.window) > self.config.window:
            p, c = w.window.popleft()
            w.w_predicted -= p
            w.w_cached -= c
        w.verdict = self._verdict(w)
        if w.verdict == "ok" or now - w.warned_at < self.config.warn_interval_s:
            return None
        w.warned_at = now
        n = len(w.window)
        if w.verdict == "overpredicted":
            return (f"worker {worker}: kvroute predicted {w.w_predicted} cached prompt tokens over its last {n} "
                    f"requests, the engine reported {w.w_cached}: predicted prefix hits are not happening. "
                    f"Likely causes: router.block_size is smaller than the engine's --page-size (SGLang caches "
                    f"whole pages only), the engine's cache was flushed or the engine restarted, its cache keeps "
                    f"less than assumed (prefix_index.cache_share), or prompts alike as text are not alike as the "
                    f"engine's tokens (its chat template)")
        return (f"worker {worker}: the engine reported {w.w_cached} cached prompt tokens over its last {n} requests, "
                f"kvroute predicted {w.w_predicted}: prefix affinity is blind to this worker's cache. Likely causes: "
                f"the router's tokenizer or chat template is not the engine's (exact mode: its blocks never match "
                f"the engine's), exact mode is not following the worker's KV events, the router's prefix index "
                f"lost its state (a restart), or other clients send to this worker directly")

    def _verdict(self, w: _Worker) -> str:
        c = self.config
        p, e = w.w_predicted, w.w_cached
        if max(p, e) < c.min_tokens:
            return "ok"
        if e < c.ratio * p:
            return "overpredicted"
        if p < c.ratio * e:
            return "blind"
        return "ok"

    def remove_worker(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def view(self, worker: str) -> dict[str, object] | None:
        """What `/workers` shows: both rates (shares of the prompt tokens) since start and over the
        window, and the verdict (`ok` | `overpredicted` | `blind`). None before its first answer."""
        w = self._workers.get(worker)
        if w is None:
            return None
        return {
            "requests": w.requests,
            "prompt_tokens": w.prompt,
            "predicted_cached_tokens": w.predicted,
            "cached_tokens": w.cached,
            "predicted_hit_rate": round(w.predicted / w.prompt, 4) if w.prompt else None,
            "hit_rate": round(w.cached / w.prompt, 4) if w.prompt else None,
            "window": {"requests": len(w.window), "predicted_cached_tokens": w.w_predicted,
                       "cached_tokens": w.w_cached},
            "verdict": w.verdict,
        }
