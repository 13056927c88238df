"""SGLang's own `ServerArgs` parses every managed-engine command line kvroute builds, and kvroute's
`PortArgs.init_new` patch fixes the scheduler's metrics address."""

from __future__ import annotations

import atexit
import re
from pathlib import Path

import pytest
import yaml

from tests.sglang.compat import RELEASE, sglang  # noqa: F401  (skips the module without sglang)

from actors.fleet import parse_fleet
from actors.worker.launcher import build_command
from serve_app.config import parse_config

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[2]


def _fleets() -> list[tuple[str, dict]]:
    """Every fleet kvroute's examples and docs show, as (where, mapping)."""
    out = [(p.name, yaml.safe_load(p.read_text())) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        doc = str(path.relative_to(ROOT))
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)):
            try:
                raw = yaml.safe_load(block)
            except yaml.YAMLError:
                continue
            if isinstance(raw, dict) and isinstance(raw.get("workers"), list):
                out.append((f"{doc}#{i}", raw))
    return out


def _sglang_specs() -> list[tuple[str, object]]:
    specs = []
    for where, raw in _fleets():
        for w in parse_config(raw, where).expanded():  # the whole tree: a file may carry router:
            if w.engine == "sglang":
                specs.append((f"{where}:{w.name}", w))
    return specs


SPECS = _sglang_specs()


def _server_args(argv: list[str]):
    """SGLang's `prepare_server_args(argv)`. Releases before 0.5.22 resolve the accelerator and load
    the model's config from its hub in `ServerArgs.__post_init__`, which a CPU-only machine with no
    network cannot do: there the argv is parsed by SGLang's own argparse parser (every flag and value
    checked) and the dataclass filled from it without that post-init step."""
    import argparse
    import dataclasses

    from sglang.srt import server_args as sa

    try:
        return sa.prepare_server_args(argv)
    except (RuntimeError, NotImplementedError, OSError) as exc:
        if "accelerator" not in str(exc) and not isinstance(exc, (NotImplementedError, OSError)):
            raise
    parser = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    args = object.__new__(sa.ServerArgs)
    for f in dataclasses.fields(sa.ServerArgs):
        setattr(args, f.name, getattr(ns, f.name, f.default if f.default is not dataclasses.MISSING else None))
    return args


def test_the_examples_and_docs_contain_managed_sglang_engines():
    assert len(SPECS) >= 2, [s[0] for s in SPECS]


@pytest.mark.parametrize("where, spec", SPECS, ids=[s[0] for s in SPECS])
def test_sglang_parses_the_command_line_kvroute_builds(where, spec):
    if spec.kv_events_endpoint == "auto":  # what the worker actor puts there once it has bound the port
        spec = spec.model_copy(update={"kv_events_endpoint": "tcp://127.0.0.1:45557",
                                       "kv_events_replay_endpoint": "tcp://127.0.0.1:45657"})
    argv, env = build_command(spec, host="127.0.0.1", port=30001, metrics_endpoint="ipc:///tmp/kvroute-x.metrics")
    assert argv[1:3] == ["-m", "actors.sglang_launch"] and env == {"KVROUTE_METRICS_IPC_NAME": "ipc:///tmp/kvroute-x.metrics"}
    args = _server_args(argv[3:])
    assert args.model_path == spec.model and args.port == 30001 and args.page_size == spec.page_size
    assert args.enable_metrics is True  # without it SGLang sends no KvMetrics
    cfg = sglang_kv_config(args.kv_events_config)
    assert cfg.publisher == "zmq" and cfg.topic == "kv-events"
    if spec.kv_events_endpoint not in (None, "auto"):
        assert (cfg.endpoint, cfg.replay_endpoint) == (spec.kv_events_endpoint, spec.kv_events_replay_endpoint)
    for key, value in spec.engine_args.items():
        assert getattr(args, key) == value, key
    if spec.role != "both":  # docs/pd.md: the role's flags reach SGLang as its own
        assert args.disaggregation_mode == spec.role
        if spec.role == "prefill":
            assert args.disaggregation_bootstrap_port == spec.bootstrap_port


def sglang_kv_config(raw: str):
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    return KVEventsConfig.from_cli(raw)


def test_the_managed_kv_config_makes_sglangs_publisher_connect_to_the_address_kvroute_bound():
    """The handshake kvroute relies on, as SGLang's own ZmqEventPublisher decides it."""
    import zmq

    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # what the worker actor does
    spec = parse_fleet({"workers": [{"name": "w", "engine": "sglang", "model": "m", "page_size": 16,
                                     "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}]}).workers[0]
    argv, _ = build_command(spec, host="127.0.0.1", port=30001, metrics_endpoint="ipc:///tmp/x")
    config = argv[argv.index("--kv-events-config") + 1]
    ke = __import__("sglang.srt.disaggregation.kv_events", fromlist=["KVEventBatch"])
    pub = EventPublisherFactory.create(config, 0)  # SGLang's rule: a concrete tcp address → it connects
    try:
        got = None
        for _ in range(100):  # PUB drops until our subscription reached it
            pub.publish(ke.KVEventBatch(ts=1.0, events=[ke.AllBlocksCleared()]))
            if sub.poll(50):
                got = sub.recv_multipart()
                break
        assert got is not None, "SGLang's publisher never reached the SUB kvroute bound"
        assert got[0] == b"kv-events" and len(got) == 3
    finally:
        pub.shutdown()
        atexit.unregister(pub.shutdown)  # SGLang registers it; once is enough
        sub.close(linger=0)


def test_kvroutes_port_args_patch_gives_the_fixed_metrics_address(monkeypatch):
    from sglang.srt import server_args

    from actors.sglang_launch import _patch_port_args

    monkeypatch.setattr(server_args.PortArgs, "init_new", server_args.PortArgs.init_new)  # restored after
    args = _server_args(["--model-path", "m", "--page-size", "16", "--enable-metrics"])
    assert server_args.PortArgs.init_new(args).metrics_ipc_name != "ipc:///tmp/kvroute-fixed.metrics"
    _patch_port_args("ipc:///tmp/kvroute-fixed.metrics")
    port_args = server_args.PortArgs.init_new(args)
    assert port_args.metrics_ipc_name == "ipc:///tmp/kvroute-fixed.metrics"
    assert port_args.scheduler_input_ipc_name.startswith("ipc://")  # the rest is SGLang's own choice
