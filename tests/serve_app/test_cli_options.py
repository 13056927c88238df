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
