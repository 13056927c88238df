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


def test_demo_with_real_engines_builds_a_managed_sglang_fleet_and_says_where_sglang_is_missing(tmp_path, monkeypatch):
    """`kvroute demo --engine sglang`: each worker an `engine: sglang` entry run in SGLang's own Python,
    on a machine without a GPU with the CPU engine's flags and env; exact mode with the model's
    tokenizer. Without SGLang's venv the error names what to run and where it looked."""
    import pytest

    from actors.fleet import FleetError
    from serve_app import cli

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    (tmp_path / "m").mkdir()
    Tokenizer(WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "m" / "tokenizer.json"))
    (tmp_path / "m" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    py = tmp_path / "python"
    fleet = cli.sglang_demo_fleet(2, tmpdir=str(tmp_path), python=py, model=tmp_path / "m", cpu=True)
    assert [w.name for w in fleet.workers] == ["sglang-0", "sglang-1"]
    w = fleet.workers[0]
    assert w.engine == "sglang" and w.python == str(py) and w.kv_events_endpoint == "auto"
    assert w.env["SGLANG_USE_CPU_ENGINE"] == "1" and w.env["PYTHONPATH"].endswith("tests/real_engine/cpu_kernels")
    assert w.engine_args["device"] == "cpu" and w.engine_args["attention_backend"] == "torch_native"
    assert fleet.router.tokenizer == f"hf:{tmp_path / 'm'}" and fleet.router.block_size == w.page_size == 16
    gpu = cli.sglang_demo_fleet(1, tmpdir=str(tmp_path), python=py, model=tmp_path / "m", cpu=False)
    assert gpu.workers[0].env == {} and "device" not in gpu.workers[0].engine_args
    monkeypatch.setenv("SGLANG_ENV_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(cli, "_REPO", tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FleetError, match=r"scripts/sglang_env.sh 0\.5\.23.*looked for"):
        cli.sglang_python(None)
    with pytest.raises(FleetError, match="not an executable file"):
        cli.sglang_python(str(tmp_path / "nope"))
