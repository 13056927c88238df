"""actors.fleet: the fleet file is validated and every error names the entry and the field."""

from __future__ import annotations

import pytest

from actors.fleet import FleetError, load_fleet, parse_fleet

GOOD = {
    "workers": [
        {"name": "w1", "url": "http://127.0.0.1:30001", "metrics_endpoint": "ipc:///tmp/w1.metrics", "page_size": 16},
        {"name": "w2", "url": "http://127.0.0.1:30002", "metrics_endpoint": "tcp://127.0.0.1:5601"},
    ]
}


def test_a_good_file_loads_with_defaults(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(
        "workers:\n"
        "  - name: w1\n    url: http://127.0.0.1:30001/\n    metrics_endpoint: ipc:///tmp/w1.metrics\n    page_size: 16\n"
    )
    fleet = load_fleet(f)
    assert fleet.workers[0].url == "http://127.0.0.1:30001"
    assert fleet.workers[0].page_size == 16
    assert fleet.settings.heartbeat_s == 0.5


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda d: d["workers"][1].update(page_size=0), "workers[1] (name 'w2').page_size"),
        (lambda d: d["workers"][0].update(url="127.0.0.1:30001"), "workers[0] (name 'w1').url"),
        (lambda d: d["workers"][1].update(metrics_endpoint="udp://x"), "workers[1] (name 'w2').metrics_endpoint"),
        (lambda d: d["workers"][1].update(metrics_endpoint="tcp://0.0.0.0:5601"), "not a wildcard"),
        (lambda d: d["workers"][0].pop("metrics_endpoint"), "attach mode needs metrics_endpoint"),
        (lambda d: d["workers"][0].update(colour="red"), "workers[0] (name 'w1').colour"),
        (lambda d: d["workers"][1].update(name="w1"), "name 'w1' is used twice"),
        (lambda d: d["workers"][1].update(metrics_endpoint="ipc:///tmp/w1.metrics"), "used twice"),
        (lambda d: d.update(workers=[]), "workers"),
        (lambda d: d.update(settings={"heartbeat_s": -1}), "settings.heartbeat_s"),
        (lambda d: d["workers"][0].update(engine="vllm"), "workers[0] (name 'w1').engine"),
        (lambda d: d["workers"][0].update(engine="sglang"), "needs model"),
    ],
)
def test_errors_name_the_entry_and_field(mutate, expect):
    import copy

    d = copy.deepcopy(GOOD)
    mutate(d)
    with pytest.raises(FleetError) as err:
        parse_fleet(d, "f.yaml")
    assert expect in str(err.value)
    assert str(err.value).startswith("f.yaml")


def test_unreadable_and_non_yaml_files_are_clear_errors(tmp_path):
    with pytest.raises(FleetError, match="cannot read"):
        load_fleet(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [\n")
    with pytest.raises(FleetError, match="not valid YAML"):
        load_fleet(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(FleetError, match="top level must be a mapping"):
        load_fleet(scalar)


def test_replicas_expand_into_numbered_workers():
    fleet = parse_fleet({"workers": [{"name": "gpu", "engine": "sim", "replicas": 3}]})
    assert [w.name for w in fleet.expanded()] == ["gpu-0", "gpu-1", "gpu-2"]


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "0", "0.0", "0x0", "000.000.000.000", "[::]"])
def test_every_spelling_of_a_wildcard_metrics_address_is_refused(host):
    d = {"workers": [{"name": "w", "url": "http://127.0.0.1:1", "metrics_endpoint": f"tcp://{host}:5601"}]}
    with pytest.raises(FleetError, match="not a wildcard"):
        parse_fleet(d)
