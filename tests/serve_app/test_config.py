"""serve_app.config: one typed tree; every knob settable, reaching the component it sets; unknown keys are errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from actors.fleet import FleetError
from serve_app.breaker import BreakerConfig
from serve_app.config import (
    AppArgs,
    RouterConfig,
    _rows,
    load_config,
    parse_config,
    sections,
)
from serve_app.ledger import LedgerConfig
from serve_app.policies.kv_aware import KvAwareConfig
from serve_app.prefix_index import KvEventIndex, PrefixIndex
from serve_app.request_facts import FactsConfig

WORKERS = [{"name": "w1", "url": "http://127.0.0.1:30001", "metrics_endpoint": "ipc:///tmp/w1.metrics"}]


def test_the_tree_holds_fleet_metrics_plane_router_and_each_router_section():
    paths = {p for p, _ in sections()}
    assert {"workers", "settings", "router", "router.kv_aware", "router.ledger", "router.prefix_index",
            "router.breaker", "router.request_facts"} <= paths


def test_every_key_of_the_tree_has_a_description():
    missing = [f"{path}.{name}" for path, tp in sections() for name, _, _, desc in _rows(tp)
               if not desc.strip()]
    assert missing == []


@pytest.mark.parametrize("path", ["settings", "router", "router.kv_aware", "router.ledger", "router.prefix_index",
                                  "router.breaker", "router.request_facts", "workers[0]"])
def test_an_unknown_key_anywhere_is_an_error_naming_the_key_its_path_and_the_valid_keys(path):
    raw: dict[str, Any] = {"workers": copy.deepcopy(WORKERS)}
    node: Any = raw
    for part in path.split("."):
        if part == "workers[0]":
            node = node["workers"][0]
        else:
            node = node.setdefault(part, {})
    node["bogus_knob"] = 1
    with pytest.raises(FleetError) as err:
        parse_config(raw, "kvroute.yaml")
    shown = path.replace("workers[0]", "workers[0] (name 'w1')")
    assert f"{shown}.bogus_knob: unknown key; valid here: " in str(err.value)


def test_a_misspelt_key_gets_a_suggestion():
    with pytest.raises(FleetError, match=r"router\.kv_aware\.tolerence: unknown key \(did you mean 'tolerance'\?\)"):
        parse_config({"workers": WORKERS, "router": {"kv_aware": {"tolerence": 0.5}}}, "f.yaml")


def test_a_router_key_that_moved_into_a_section_says_where_it_went():
    with pytest.raises(FleetError, match="breaker_failures is now breaker.failures_to_open"):
        parse_config({"workers": WORKERS, "router": {"breaker_failures": 2}}, "f.yaml")


def test_kv_aware_knobs_keep_their_types():
    cfg = RouterConfig.model_validate({"kv_aware": {"min_overlap_blocks": 3, "normalize_by_capacity": False,
                                                    "tolerance": 0.5}})
    assert cfg.kv_aware.min_overlap_blocks == 3 and type(cfg.kv_aware.min_overlap_blocks) is int
    assert cfg.kv_aware.normalize_by_capacity is False
    with pytest.raises(ValueError, match="min_overlap_blocks"):
        RouterConfig.model_validate({"kv_aware": {"min_overlap_blocks": 1.5}})
    with pytest.raises(ValueError, match="kv_high_watermark"):
        RouterConfig.model_validate({"kv_aware": {"kv_high_watermark": 1.5}})


def test_defaults_are_the_owning_modules_defaults():
    cfg = RouterConfig()
    assert cfg.kv_aware == KvAwareConfig()
    assert cfg.ledger == LedgerConfig()
    assert cfg.breaker == BreakerConfig()
    assert cfg.facts_config() == FactsConfig()
    ix, default = PrefixIndex(**cfg.prefix_index.approximate_kwargs()), PrefixIndex()
    assert (ix.ttl_s, ix.max_entries, ix.hot_window_s, ix.fresh_window_s) == (
        default.ttl_s, default.max_entries, default.hot_window_s, default.fresh_window_s)
    assert cfg.prefix_index.max_blocks_per_source == KvEventIndex(16).max_blocks_per_source


def test_every_router_section_reaches_the_component_it_configures():
    from serve_app.follower import FleetFollower
    from serve_app.router import RouterCore

    async def _unused() -> Any:
        raise AssertionError("not following an aggregator here")

    cfg = RouterConfig.model_validate({
        "block_size": 32,
        "kv_aware": {"tolerance": 0.3, "min_overlap_blocks": 4},
        "ledger": {"remote_ttl_s": 7.0, "followup_window_s": 2.5},
        "prefix_index": {"ttl_s": 30, "max_entries": 1000, "hot_window_s": 4, "fresh_window_s": 1,
                         "max_blocks_per_source": 5000},
        "request_facts": {"chars_per_token": 3, "max_blocks": 100},
    })
    core = RouterCore(cfg, FleetFollower(_unused), "r0")
    assert core.policy("kv_aware").config == cfg.kv_aware
    assert core.ledger.config == cfg.ledger and core.ledger.block_tokens == 32
    assert (core.prefix.ttl_s, core.prefix.max_entries, core.prefix.hot_window_s, core.prefix.fresh_window_s) == (
        30, 1000, 4, 1)
    assert core.exact.max_blocks_per_source == 5000 and core.exact.block_tokens == 32
    assert core.facts_config == FactsConfig(block_tokens=32, chars_per_token=3, max_blocks=100)


def test_breaker_section_validates_like_the_flat_keys_did():
    cfg = RouterConfig.model_validate({"breaker": {"failures_to_open": 2, "open_s": 30}})
    assert cfg.breaker == BreakerConfig(2, 30)
    for bad in ({"failures_to_open": 0}, {"open_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterConfig.model_validate({"breaker": bad})


def test_a_fleet_file_carries_the_router_section(tmp_path):
    f = tmp_path / "kvroute.yaml"
    f.write_text(
        "workers:\n  - {name: w1, url: 'http://127.0.0.1:30001', metrics_endpoint: 'ipc:///tmp/w1.metrics'}\n"
        "settings: {heartbeat_s: 0.25}\n"
        "router: {policy: round_robin, ledger: {report_latency_s: 0.2}, breaker: {open_s: 9}}\n"
    )
    cfg = load_config(f)
    assert cfg.settings.heartbeat_s == 0.25
    assert (cfg.router.policy, cfg.router.ledger.report_latency_s, cfg.router.breaker.open_s) == ("round_robin", 0.2, 9)


def test_the_serve_app_takes_its_router_only_from_args_router(tmp_path):
    with pytest.raises(ValueError, match="args.router"):
        AppArgs.model_validate({"fleet": {"workers": WORKERS, "router": {"policy": "round_robin"}}})
    f = tmp_path / "fleet.yaml"
    f.write_text("workers:\n  - {name: w1, url: 'http://127.0.0.1:30001', metrics_endpoint: 'ipc:///x'}\n"
                 "router: {policy: round_robin}\n")
    with pytest.raises(FleetError, match="args.router"):
        AppArgs.model_validate({"fleet": str(f)}).fleet_spec()


def test_app_args_survive_the_json_round_trip_build_app_makes():
    args = AppArgs.model_validate({
        "fleet": {"workers": WORKERS, "settings": {"heartbeat_s": 0.25}},
        "router": {"kv_aware": {"min_overlap_blocks": 2}, "breaker": {"open_s": 3}, "prefix_index": {"ttl_s": 60}},
    })
    again = AppArgs.model_validate(args.model_dump(mode="json"))
    assert again == args
    assert again.fleet_spec().settings.heartbeat_s == 0.25 and again.router.kv_aware.min_overlap_blocks == 2


def test_namespace_and_deployment_name_are_defined_once_and_shared():
    import actors.models
    import serve_app.config
    import serve_app.deploy_check

    assert serve_app.config.NAMESPACE is actors.models.NAMESPACE
    assert "ROUTER_DEPLOYMENT" not in vars(serve_app.deploy_check)  # no copy of the deployment name
    assert serve_app.deploy_check.DEPLOYMENT_NAME is serve_app.config.DEPLOYMENT_NAME


def test_every_fleet_file_in_the_examples_and_docs_is_a_valid_config():
    import re
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    found = []
    for p in sorted((root / "examples").glob("*.yaml")):
        found.append(p.name)
        parse_config(yaml.safe_load(p.read_text()), p.name)
    for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", p.read_text(), re.S)):
            raw = yaml.safe_load(block)
            if isinstance(raw, dict) and isinstance(raw.get("workers"), list):
                found.append(f"{p.name}#{i}")
                parse_config(raw, f"{p.name}#{i}")
    assert "configuration.md#0" in found and "fleet-sim.yaml" in found


def test_serve_args_without_a_fleet_can_still_set_the_metrics_plane_settings():
    from serve_app.config import AppArgs

    args = AppArgs.model_validate({"settings": {"heartbeat_s": 0.7}})
    assert args.fleet_spec() is None and args.plane_settings().heartbeat_s == 0.7
    assert AppArgs.model_validate({}).plane_settings() == AppArgs.model_validate({}).plane_settings().__class__()
    with pytest.raises(ValueError, match="only for a deployment without args.fleet"):
        AppArgs.model_validate({"settings": {"heartbeat_s": 0.7}, "fleet": {"workers": WORKERS}})


def test_router_gc_thresholds_default_to_fewer_collections_and_refuse_switching_gc_off():
    from serve_app.config import RouterConfig

    assert RouterConfig().gc_thresholds == (20_000, 20, 20)
    assert RouterConfig(gc_thresholds=[1000, 10, 10]).gc_thresholds == (1000, 10, 10)
    assert RouterConfig(gc_thresholds=None).gc_thresholds is None
    with pytest.raises(ValueError, match="≥ 1"):
        RouterConfig(gc_thresholds=[0, 10, 10])
