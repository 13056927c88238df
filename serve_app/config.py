"""kvroute's whole configuration as one validated tree, its loaders, and the generator of docs/configuration.md.

The tree (`KvrouteConfig`, unknown keys are errors naming the key and its path):

    workers: [WorkerSpec]        the fleet                          actors.fleet
    settings: Settings           the metrics plane                  actors.models
    router: RouterConfig         one router deployment              here
      kv_aware: KvAwareConfig      the kv_aware policy's knobs        serve_app.policies.kv_aware
      ledger: LedgerConfig         the in-flight ledger               serve_app.ledger
      prefix_index: PrefixIndexConfig   approximate and exact prefix indexes   here
      breaker: BreakerConfig       per-worker circuit breakers        serve_app.breaker
      admission: AdmissionConfig   late binding of big prompts        serve_app.admission
      request_facts: RequestFactsConfig  how prompts become blocks    here

It lives here, not in `actors/`, because it embeds the router's sections (which import the
policies) and `actors/` must not import `serve_app/`; the metrics-plane parts stay in `actors/`
(the actors need them) and are embedded by import. Sections owned by other modules are embedded
as those modules define them (their defaults and docstrings are the one source); this module
builds the objects they take (`RouterConfig.facts_config`, `PrefixIndexConfig.approximate_kwargs`).

Where each part is set — every key has exactly one place per entry point:
- `kvroute serve --fleet FILE`: the file holds `workers`, `settings` and `router`; `kvroute demo|serve`
  flags (`CLI_FLAGS`) override single router keys.
- `serve deploy` (`AppArgs`, the app's `args:`): `fleet` (a file path or inline mapping with
  `workers` and `settings`), `router`, and the deployment's `replica_resources`, `manage_fleet`.

`python -m serve_app.config --docs` rewrites docs/configuration.md from these models.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.fleet import FleetError, FleetSpec, WorkerSpec, load_fleet, parse_fleet, read_fleet_file
from actors.models import NAMESPACE, Settings
from serve_app.admission import AdmissionConfig
from serve_app.breaker import BreakerConfig
from serve_app.ledger import LedgerConfig
from serve_app.policies import DEFAULT_POLICY
from serve_app.policies.kv_aware import KvAwareConfig
from serve_app.prediction import PredictionCheckConfig
from serve_app.prefix_index import KvEventIndex, PrefixIndex
from serve_app.request_facts import DEFAULT_FACTS, FactsConfig

__all__ = [
    "ADMIN_KEY_ENV", "API_KEY_ENV", "APP_NAME", "CLI_FLAGS", "DEPLOYMENT_NAME", "NAMESPACE",
    "AppArgs", "KvrouteConfig", "PrefixIndexConfig", "RequestFactsConfig", "RouterConfig",
    "fleet_for_app", "load_config", "parse_config", "render_docs", "sections",
]

API_KEY_ENV = "KVROUTE_API_KEY"
ADMIN_KEY_ENV = "KVROUTE_ADMIN_KEY"
DEPLOYMENT_NAME = "KvRouter"  # the Serve deployment of the router (deploy files name it in `deployments:`)
APP_NAME = "kvroute"  # the Serve application `kvroute serve|down` run and delete

# `kvroute demo|serve` flags that set a router key (flag → key of RouterConfig); the CLI builds
# its options from this table and docs/configuration.md lists it.
CLI_FLAGS: dict[str, str] = {
    "--policy": "policy",
    "--api-key": "api_key",
    "--admin-key": "admin_key",
    "--max-body-bytes": "max_body_bytes",
    "--tokenizer": "tokenizer",
    "--block-size": "block_size",
    "--stream-batching-ms": "stream_batching_interval_ms",
}

# Router keys that moved into a section: a file still using them gets an error saying where to.
_MOVED = {
    "breaker_failures": "breaker.failures_to_open",
    "breaker_open_s": "breaker.open_s",
}

_SECTION = ConfigDict(extra="forbid", frozen=True)


def _default_of(func: Any, name: str) -> Any:
    """The default of keyword `name` of `func` (the owner's signature stays the one source)."""
    return inspect.signature(func).parameters[name].default


def _doc_of(cls: type, name: str) -> str:
    """The attribute docstring of dataclass field `name` of `cls` (the owner's text, not a copy)."""
    class _Probe(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)
        x: cls  # type: ignore[valid-type]

    schema = _Probe.model_json_schema()
    return " ".join(schema["$defs"][cls.__name__]["properties"][name].get("description", "").split())


class PrefixIndexConfig(BaseModel):
    """Memory bounds and time windows of the router's prefix indexes (one per router replica)."""

    model_config = _SECTION

    ttl_s: float = Field(
        _default_of(PrefixIndex.__init__, "ttl_s"), gt=0,
        description="approximate index: a block hash not sent anywhere for this long is forgotten",
    )
    max_entries: int = Field(
        _default_of(PrefixIndex.__init__, "max_entries"), ge=1,
        description="approximate index: block hashes kept at most (least recently used dropped first); "
        "bounds the replica's memory",
    )
    hot_window_s: float = Field(
        _default_of(PrefixIndex.__init__, "hot_window_s"), gt=0,
        description="a block sent to a worker twice or more counts as hot (kv_aware prices evicting it) "
        "while reused within this window",
    )
    fresh_window_s: float = Field(
        _default_of(PrefixIndex.__init__, "fresh_window_s"), ge=0,
        description="a block first sent to a worker within this window also counts as hot (its second "
        "request may be on its way); at most hot_window_s",
    )
    cache_share: float = Field(
        1.0, ge=0, le=4,
        description="approximate index: each worker's cache is followed as an LRU cache of this share of "
        "the KV pool it reports (kv_total_blocks × page_size tokens, in router blocks of block_size × "
        "request_facts.chars_per_token characters; above 1 when the tokenizer has more characters per "
        "token than that estimate); what newer prompts pushed out (deepest blocks first, oldest first) "
        "is charged to the worker as prefill again. 0: entries age by ttl_s only",
    )
    max_blocks_per_source: int = Field(
        _default_of(KvEventIndex.__init__, "max_blocks_per_source"), ge=1,
        description="exact index (KV events): blocks kept per worker and DP rank at most",
    )

    @model_validator(mode="after")
    def _fresh_within_hot(self) -> "PrefixIndexConfig":
        if self.fresh_window_s > self.hot_window_s:
            raise ValueError(f"fresh_window_s ({self.fresh_window_s:g}) must not exceed hot_window_s "
                             f"({self.hot_window_s:g}): a block sent once cannot stay hot longer than a reused one")
        return self

    def approximate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `PrefixIndex` (add `clock`)."""
        return {"ttl_s": self.ttl_s, "max_entries": self.max_entries, "hot_window_s": self.hot_window_s,
                "fresh_window_s": self.fresh_window_s}


class PredictionCheckSettings(BaseModel):
    """The router checking its predicted prefix reuse against the engine's `cached_tokens`
    (`serve_app.prediction`): when a worker's predictions count as diverging."""

    model_config = _SECTION

    enabled: bool = Field(True, description="read the engine's usage.prompt_tokens_details.cached_tokens from "
                          "every answer (asking a chat/completion stream for its usage chunk, which is not relayed "
                          "unless the client asked for it) and compare it with the router's prediction")
    window: int = Field(PredictionCheckConfig().window, ge=1,
                        description="requests per worker the judgement looks at (the newest)")
    min_tokens: int = Field(PredictionCheckConfig().min_tokens, ge=1,
                            description="judge only once the window's larger side (predicted or engine-reported "
                            "cached prompt tokens) holds this many")
    ratio: float = Field(PredictionCheckConfig().ratio, gt=0, lt=1,
                         description="diverging when one side of the window is below this share of the other: a "
                         "warning names the worker and the likely cause")
    warn_interval_s: float = Field(PredictionCheckConfig().warn_interval_s, ge=0,
                                   description="at most one warning per worker this often while it keeps diverging")

    def check_config(self) -> PredictionCheckConfig:
        return PredictionCheckConfig(self.window, self.min_tokens, self.ratio, self.warn_interval_s)


class RequestFactsConfig(BaseModel):
    """How a text prompt becomes blocks; the block size itself is `router.block_size`."""

    model_config = _SECTION

    chars_per_token: int = Field(
        DEFAULT_FACTS.chars_per_token, ge=1, description=_doc_of(FactsConfig, "chars_per_token")
    )
    max_blocks: int = Field(DEFAULT_FACTS.max_blocks, ge=1, description=_doc_of(FactsConfig, "max_blocks"))


class RouterConfig(BaseModel):
    """How one router deployment behaves (`router:` in the fleet file or the Serve app args)."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(DEFAULT_POLICY, description="default policy; the x-kvroute-policy header overrides it")
    strict_models: bool = Field(
        False, description="a `model` no worker declares is 404 model_not_found on a single-model fleet too "
        "(OpenAI's rule); false: a single-model fleet answers any `model` and none, as SGLang does (a "
        "multi-model fleet always answers 404 for a name no worker serves)")
    api_key: str | None = Field(
        None, description=f"Bearer key for every route but /healthz, ≥ 8 characters (env {API_KEY_ENV})"
    )
    admin_key: str | None = Field(
        None,
        description=f"Bearer key for fleet changes, ≥ 8 characters; unset = /admin disabled (env {ADMIN_KEY_ENV})",
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="request bodies above are refused (413)")
    max_header_bytes: int = Field(64 * 1024, gt=0, description="requests with larger headers are refused (431)")
    block_size: int = Field(
        16, ge=1,
        description="prefix blocks in tokens, for the prefix indexes, the ledger and prompt hashing "
        "(= the engines' page_size for exact mode)",
    )
    tokenizer: str = Field(
        "none",
        description="tokenize prompts like the engine, for exact prefix mode from KV events: "
        "none | sim | hf:<dir with the model's tokenizer.json and chat template>",
    )
    upstream_connect_timeout_s: float = Field(
        10.0, gt=0,
        description="connecting to a worker (TCP connect, + TLS for https); a timeout is retried on another worker but "
        "never opens the worker's breaker (overload or this replica's own loop lag, not a dead worker: liveness "
        "probes mark dead workers down within seconds)",
    )
    upstream_read_timeout_s: float = Field(
        600.0, gt=0, description="each wait for a worker's answer: its response head, then every body read")
    stream_batching_interval_ms: float = Field(
        50.0, ge=0, le=1000,
        description="streamed replies: the first two SSE events (role chunk, first token) go out at once, "
        "later chunks go out together at most this long apart, on ticks of a clock the replica's streams share "
        "(their pieces leave in one event-loop wake-up; the end at once, unless stream_batching_hold_reads). "
        "0 = one piece per upstream read",
    )
    stream_batching_hold_reads: bool = Field(
        False,
        description="from a stream's second batching interval on, while a batched piece waits the worker's "
        "connection is not read: its tokens wait in the kernel's socket buffer and are read in one go when the "
        "interval ends (one loop wake-up, read and parser pass per piece instead of per token; 0.2–0.5 ms of relay "
        "CPU per stream, bench/results/request-path-2.md). The cost: the end of a stream longer than that is seen "
        "only when its interval ends (the next tick), so the last piece waits like the others "
        "(≤ stream_batching_interval_ms): on an idle worker a reply's end came 14–45 ms later than asked directly, "
        "against 2 ms without it (`python -m bench.hop`, bench/results/dynamo.md). false (default): read as tokens "
        "arrive, the end leaves the moment it arrives",
    )
    gc_thresholds: tuple[int, int, int] | None = Field(
        (20_000, 20, 20),
        description="Python's garbage-collector thresholds in each router replica (`gc.set_threshold`: "
        "allocations before a young collection, then collections of each generation before the next); "
        "null keeps Python's (700, 10, 10). The prefix index holds ~10⁵ long-lived objects that every older "
        "collection traverses: at Python's thresholds that was 3.5 % of the replica's CPU, at these 0.5 % "
        "(bench/results/request-path-2.md)",
    )
    decision_log: str | None = Field(
        None, description="append one JSON line per decision to this file (time, chosen worker, reason, "
        "overlap and every candidate's view with its metrics age) — for diagnosing routing on real traffic",
    )
    max_attempts: int = Field(3, ge=1, description="tries on different workers before the first byte")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="concurrent requests per router replica (Serve's default of 5 would queue the "
        "6th open stream)",
    )
    num_replicas: int | str = Field(1, description="router replicas, or 'auto' (with a Serve autoscaling_config)")
    seed: int | None = Field(None, description="seed of the policies' random choices (None = random)")
    kv_aware: KvAwareConfig = Field(
        default_factory=KvAwareConfig, description="the kv_aware policy's knobs (costs in prompt blocks)"
    )
    ledger: LedgerConfig = Field(default_factory=LedgerConfig, description="the in-flight ledger")
    prefix_index: PrefixIndexConfig = Field(default_factory=PrefixIndexConfig, description="the prefix indexes")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="per-worker circuit breakers")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig,
        description="late binding: big streamed prompts wait in the router while every worker is prefilling")
    request_facts: RequestFactsConfig = Field(
        default_factory=RequestFactsConfig, description="how prompts become blocks"
    )
    prediction_check: PredictionCheckSettings = Field(
        default_factory=PredictionCheckSettings,
        description="predicted prefix reuse checked against the engines' cached_tokens")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [k for k in data if k in _MOVED]
            if moved:
                raise ValueError("; ".join(f"{k} is now {_MOVED[k]}" for k in moved))
        return data

    @field_validator("num_replicas")
    @classmethod
    def _replicas(cls, v: int | str) -> int | str:
        if isinstance(v, str) and v != "auto":
            raise ValueError("must be a number of replicas or 'auto'")
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, v: str) -> str:
        from serve_app.prompt_tokens import load_tokenizer

        load_tokenizer(v)  # TokenizerError (a ValueError) names the missing file or bad template
        return v

    @field_validator("policy")
    @classmethod
    def _policy_known(cls, v: str) -> str:
        from serve_app.policies import get_policy

        get_policy(v)  # UnknownPolicy lists the valid names
        return v

    @field_validator("api_key", "admin_key")
    @classmethod
    def _nonempty(cls, v: str | None) -> str | None:
        if v is not None and len(v) < 8:
            raise ValueError("keys must be at least 8 characters")
        return v

    @field_validator("gc_thresholds")
    @classmethod
    def _gc_thresholds_positive(cls, v: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if v is not None and min(v) < 1:
            raise ValueError("every threshold must be ≥ 1 (0 would switch the collector off; null keeps Python's)")
        return v

    def with_env(self) -> "RouterConfig":
        """Fill keys from the environment when not given explicitly."""
        upd: dict[str, Any] = {}
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            upd["api_key"] = os.environ[API_KEY_ENV]
        if self.admin_key is None and os.environ.get(ADMIN_KEY_ENV):
            upd["admin_key"] = os.environ[ADMIN_KEY_ENV]
        return self.model_validate({**self.model_dump(), **upd}) if upd else self

    def facts_config(self) -> FactsConfig:
        """The request-facts settings with the router's block size."""
        return FactsConfig(block_tokens=self.block_size, chars_per_token=self.request_facts.chars_per_token,
                           max_blocks=self.request_facts.max_blocks)


class KvrouteConfig(FleetSpec):
    """The whole tree: what a fleet file given to `kvroute serve --fleet` holds."""

    router: RouterConfig = Field(
        default_factory=RouterConfig, description="the router (kvroute demo|serve flags override single keys)"
    )


def parse_config(raw: Any, source: str = "config") -> KvrouteConfig:
    """Validate a loaded mapping as the whole tree. Raises FleetError naming the key and its path."""
    return typing.cast(KvrouteConfig, parse_fleet(raw, source, KvrouteConfig))


def load_config(path: str | Path) -> KvrouteConfig:
    """Read and validate a fleet/config YAML file. Raises FleetError naming file, key and path."""
    return typing.cast(KvrouteConfig, load_fleet(path, KvrouteConfig))


def fleet_for_app(raw: Any, source: str) -> FleetSpec:
    """A fleet mapping as the Serve app takes it: `workers` and `settings` (its router is set in
    `args.router`). Raises FleetError naming the key and its path."""
    if isinstance(raw, dict) and "router" in raw:
        raise FleetError(f"{source}: router: a fleet given to the Serve app holds workers and settings; "
                         "set the router's keys in the app's args.router (one place for each key)")
    return parse_fleet(raw, source)


class AppArgs(BaseModel):
    """Arguments of `serve_app.app:build_app` (from `serve deploy` YAML `args:` or the CLI)."""

    model_config = ConfigDict(extra="forbid")

    fleet: str | FleetSpec | None = Field(
        None, description="fleet file path or inline mapping (workers, settings); None = workers added at run time"
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="the router")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each router replica requests (e.g. kvroute_head)"
    )
    manage_fleet: bool = Field(
        True, description="router replicas make sure every fleet worker has its (detached) actor"
    )
    settings: Settings | None = Field(
        None, description="the metrics plane's settings when no `fleet` is given (workers added at run "
                          "time); with a fleet they go in the fleet's own `settings`"
    )

    @model_validator(mode="after")
    def _one_settings(self) -> "AppArgs":
        if self.settings is not None and self.fleet is not None:
            raise ValueError("args.settings is only for a deployment without args.fleet: "
                             "put the settings in the fleet's `settings` instead")
        return self

    def plane_settings(self) -> Settings:
        """The metrics plane's settings: the fleet's, else `settings`, else the defaults."""
        fleet = self.fleet_spec()
        if fleet is not None:
            return fleet.settings
        return self.settings or Settings()

    def fleet_spec(self) -> FleetSpec | None:
        """The fleet (its file read now). Raises FleetError if the file is invalid or sets `router`."""
        if self.fleet is None or isinstance(self.fleet, FleetSpec):
            return self.fleet
        return fleet_for_app(read_fleet_file(self.fleet), self.fleet)

    @field_validator("fleet", mode="before")
    @classmethod
    def _fleet(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return fleet_for_app(v, "args.fleet")
        return v


# --------------------------------------------------------------------------- docs/configuration.md

DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
_BEGIN = "<!-- generated by `python -m serve_app.config --docs`: edit the models, not this part -->"
_END = "<!-- end of the generated part -->"


def _type_name(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", None) if isinstance(tp, type) else repr(tp)
    text = str(text).replace("typing.", "").replace("NoneType", "None")
    text = re.sub(r"\b(?:[a-z_]+\.)+([A-Za-z_]+)", r"\1", text)  # module paths → bare names
    return re.sub(r"^Optional\[(.*)\]$", r"\1 | None", text)


def _rows(tp: type) -> list[tuple[str, Any, Any, str]]:
    """(key, annotation, default, description) of every field of a model or dataclass."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        out = []
        for name, f in tp.model_fields.items():
            default = f.get_default(call_default_factory=True) if not f.is_required() else "(required)"
            out.append((name, f.annotation, default, f.description or ""))
        return out
    hints = typing.get_type_hints(tp)
    return [
        (f.name, hints[f.name],
         f.default if f.default is not dataclasses.MISSING else f.default_factory(),  # type: ignore[misc]
         _doc_of(tp, f.name))
        for f in dataclasses.fields(tp)
    ]


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp))


def sections(tp: type | None = None, path: str = "") -> list[tuple[str, type]]:
    """(dotted path, model or dataclass) of every section of the tree (default: `KvrouteConfig`), the
    root first with path '' ; list items appear once (`workers`)."""
    from actors.fleet import model_in

    tp = tp or KvrouteConfig
    out: list[tuple[str, type]] = [(path, tp)]
    for name, ann, _, _ in _rows(tp):
        sub = model_in(ann)
        if _is_section(sub):
            out += sections(sub, f"{path}.{name}" if path else name)
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default_text(v: Any) -> str:
    if isinstance(v, BaseModel) or dataclasses.is_dataclass(v):
        return "(section)"
    if v == "(required)":
        return v
    if isinstance(v, bool) or v is None:
        return f"`{str(v).lower() if isinstance(v, bool) else 'null'}`"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1e6:
        return f"`{int(v)}`"
    return f"`{v!r}`" if isinstance(v, str) else f"`{v}`"


def _section_md(path: str, tp: type) -> list[str]:
    doc = (inspect.getdoc(tp) or "").split("\n\n")[0].replace("\n", " ")
    lines = [f"### `{path}`", "", f"`{tp.__module__}.{tp.__qualname__}`: {doc}", "",
             "| key | type | default | description |", "|---|---|---|---|"]
    subs: list[tuple[str, type]] = []
    for name, ann, default, desc in _rows(tp):
        if _is_section(ann):
            subs.append((name, ann))
            sub_path = f"{path}.{name}"
            lines.append(f"| `{name}` | section | | {_cell(desc)} — see [`{sub_path}`](#{_anchor(sub_path)}) |")
            continue
        lines.append(f"| `{name}` | `{_cell(_type_name(ann))}` | {_cell(_default_text(default))} | {_cell(desc)} |")
    lines.append("")
    for name, sub in subs:
        lines += _section_md(f"{path}.{name}", sub)
    return lines


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '_' and '-' dropped, spaces → '-'."""
    return re.sub(r"[^a-z0-9_ -]", "", heading.lower()).replace(" ", "-")


def render_docs() -> str:
    """The generated part of docs/configuration.md (every key, type, default and description)."""
    flags = "\n".join(f"| `{flag}` | `router.{key}` |" for flag, key in CLI_FLAGS.items())
    out = [
        _BEGIN,
        "",
        "## Reference",
        "",
        "Where each part is set (one place per key and entry point; unknown keys are errors naming the key",
        "and its path):",
        "",
        "- `kvroute serve --fleet FILE`: the file holds `workers`, `settings` and `router`; the command's",
        "  flags below override single router keys.",
        "- `serve deploy` / `serve run` (`deploy/serve_config.yaml`, `applications[].args`): `fleet` (a fleet",
        "  file path or inline mapping with `workers` and `settings` — a `router` there is an error), `router`,",
        "  `replica_resources`, `manage_fleet`.",
        f"- Environment: `{API_KEY_ENV}` and `{ADMIN_KEY_ENV}` fill `router.api_key` / `router.admin_key`",
        "  when they are not set.",
        "",
        "| `kvroute demo\\|serve` flag | sets |",
        "|---|---|",
        flags,
        "",
    ]
    out += _section_md("workers[]", WorkerSpec)
    out += _section_md("settings", Settings)
    out += _section_md("router", RouterConfig)
    serve_only = [
        "### Serve app args",
        "",
        f"`{AppArgs.__module__}.AppArgs`: {inspect.getdoc(AppArgs)}",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    for name, ann, default, desc in _rows(AppArgs):
        shown = "section" if name == "router" else f"`{_cell(_type_name(ann))}`"
        desc = f"{desc} — see [`router`](#{_anchor('router')})" if name == "router" else desc
        serve_only.append(f"| `{name}` | {shown} | {_cell(_default_text(default))} | {_cell(desc)} |")
    out += serve_only + ["", _END]
    return "\n".join(out) + "\n"


def _splice(text: str, generated: str) -> str:
    if _BEGIN in text and _END in text:
        head, rest = text.split(_BEGIN, 1)
        return head + generated.rstrip("\n") + rest.split(_END, 1)[1]
    return text.rstrip("\n") + "\n\n" + generated


def main(argv: list[str] | None = None) -> int:
    """`--docs [PATH]` rewrites the generated part of docs/configuration.md; `--check` fails if stale."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m serve_app.config", description=main.__doc__)
    p.add_argument("--docs", nargs="?", const=str(DOCS_PATH), default=None, metavar="PATH")
    p.add_argument("--check", action="store_true", help="exit 1 when the file differs from the models")
    ns = p.parse_args(argv)
    path = Path(ns.docs or DOCS_PATH)
    current = path.read_text() if path.exists() else "# Configuration\n"
    wanted = _splice(current, render_docs())
    if ns.check:
        if wanted != current:
            print(f"{path} is stale: run python -m serve_app.config --docs", file=sys.stderr)
            return 1
        return 0
    if ns.docs is None:
        p.print_help()
        return 2
    path.write_text(wanted)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from serve_app.config import main as _main  # the module's own classes, not __main__'s copies

    sys.exit(_main())
