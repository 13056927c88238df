"""Router options on the command line reach RouterConfig, validated (no Ray)."""

from __future__ import annotations

import pytest

from serve_app.cli import _router_config, build_parser


def _cfg(*argv: str):
    return _router_config(build_parser().parse_args(["demo", *argv]))


def test_stream_batching_flag_sets_the_interval_and_defaults_to_50_ms():
    assert _cfg().stream_batching_interval_ms == 50.0
    assert _cfg("--stream-batching-ms", "0").stream_batching_interval_ms == 0.0
    assert _cfg("--stream-batching-ms", "12.5").stream_batching_interval_ms == 12.5


@pytest.mark.parametrize("bad", ["-1", "5000"])
def test_stream_batching_out_of_range_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="stream_batching_interval_ms"):
        _cfg("--stream-batching-ms", bad)


def test_every_router_flag_is_on_demo_and_serve_and_names_a_router_key():
    from serve_app.config import CLI_FLAGS, RouterConfig

    values = {"policy": "round_robin", "api_key": "k" * 12, "admin_key": "a" * 12, "max_body_bytes": 1000,
              "tokenizer": "sim", "block_size": 32, "stream_batching_interval_ms": 20.0}
    assert set(values) == set(CLI_FLAGS.values())
    parser = build_parser()
    for cmd in (["demo"], ["serve", "--fleet", "f.yaml"]):
        for flag, key in CLI_FLAGS.items():
            assert key in RouterConfig.model_fields
            ns = parser.parse_args([*cmd, flag, str(values[key])])
            assert getattr(_router_config(ns), key) == values[key]


def test_flags_override_single_keys_of_the_fleet_files_router(tmp_path):
    from serve_app.config import load_config

    f = tmp_path / "kvroute.yaml"
    f.write_text("workers:\n  - {name: w1, url: 'http://127.0.0.1:30001', metrics_endpoint: 'ipc:///x'}\n"
                 "router: {policy: round_robin, block_size: 32, ledger: {remote_ttl_s: 9}}\n")
    base = load_config(f).router
    ns = build_parser().parse_args(["serve", "--fleet", str(f), "--block-size", "64"])
    cfg = _router_config(ns, base)
    assert (cfg.policy, cfg.block_size, cfg.ledger.remote_ttl_s) == ("round_robin", 64, 9)


def test_a_zero_flag_value_is_validated_not_ignored():
    with pytest.raises(ValueError, match="max_body_bytes"):
        _cfg("--max-body-bytes", "0")
