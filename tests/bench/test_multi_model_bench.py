"""The benchmark's two-model fleet: traces name models, targets send each model where it is served,
and the fleet file splits the workers (no Ray: the pieces bench.run composes)."""

import json

import pytest

from bench.loadgen import Target, chat_body
from bench.run import SUITES, model_check
from bench.targets import BenchFleet
from bench.workloads import make_trace, with_models


def test_a_group_asks_for_one_model_and_the_models_share_the_sessions():
    trace = make_trace("shared_prefix", 3, 12, 10, groups=8, system_tokens=64, question_tokens=8)
    two = with_models(trace, ["A", "B"])
    assert [s.sid for s in two.sessions] == [s.sid for s in trace.sessions]  # same trace otherwise
    by_group: dict[int, set[str]] = {}
    for s in two.sessions:
        by_group.setdefault(s.group, set()).add(s.model)
    assert all(len(m) == 1 for m in by_group.values())
    assert {next(iter(m)) for g, m in by_group.items() if g % 2 == 0} == {"A"}
    assert {next(iter(m)) for g, m in by_group.items() if g % 2 == 1} == {"B"}
    conv = with_models(make_trace("multi_turn", 3, 8, 10), ["A", "B"])
    models = [s.model for s in conv.sessions]
    assert models.count("A") - models.count("B") in (0, 1)
    assert with_models(trace, ["A"]) is trace
    assert json.loads(chat_body([{"role": "user", "content": "x"}], 4, "B"))["model"] == "B"


def test_a_target_with_per_model_urls_never_sends_a_model_elsewhere():
    t = Target("r", ("http://a1", "http://a2", "http://b1"), by_model={"A": ("http://a1", "http://a2"), "B": ("http://b1",)})
    assert {t.endpoint(i, "A") for i in range(4)} == {"http://a1/v1/chat/completions", "http://a2/v1/chat/completions"}
    assert {t.endpoint(i, "B") for i in range(4)} == {"http://b1/v1/chat/completions"}
    with pytest.raises(KeyError, match="not 'C'"):
        t.endpoint(0, "C")
    with pytest.raises(KeyError):
        t.endpoint(0)  # a multi-model target needs the model
    single = Target("one", ("http://x",))
    assert single.endpoint(5, "anything") == "http://x/v1/chat/completions"


def test_the_fleet_splits_the_workers_between_the_models():
    fleet = BenchFleet(4, {"page_size": 16}, models=("A", "B"))
    ws = fleet.fleet_dict()["workers"]
    assert [(w["model"], w["served_model_names"]) for w in ws] == [("A", ["A"]), ("A", ["A"]), ("B", ["B"]), ("B", ["B"])]
    fleet.worker_urls = {w["name"]: w["url"] for w in ws}
    assert fleet.workers_of() == {"A": (ws[0]["url"], ws[1]["url"]), "B": (ws[2]["url"], ws[3]["url"])}
    with pytest.raises(ValueError, match="cannot serve 3 models"):
        BenchFleet(2, {}, models=("A", "B", "C")).fleet_dict()
    assert BenchFleet(2, {}).fleet_dict()["workers"][0]["served_model_names"] == ["kvroute-sim", "default"]
    assert SUITES["two_model"]["models"] == ["model-A", "model-B"]


def test_model_check_counts_what_each_models_workers_served():
    from bench.loadgen import RequestResult

    trace = with_models(make_trace("shared_prefix", 1, 12, 2, groups=2, system_tokens=16, question_tokens=4), ["A", "B"])
    results = [RequestResult(s.sid, 0, s.group, 0, 0, status=200) for s in trace.sessions]
    sent = {m: sum(1 for s in trace.sessions if s.model == m) for m in ("A", "B")}
    urls = {"w0": "u0", "w1": "u1"}
    right = {"w0": {"requests": sent["A"]}, "w1": {"requests": sent["B"]}}
    out = model_check(trace, results, right, {"A": ("u0",), "B": ("u1",)}, urls)
    assert out == {"A": {"sent": sent["A"], "served_by_its_workers": sent["A"]},
                   "B": {"sent": sent["B"], "served_by_its_workers": sent["B"]}}
    wrong = {"w0": {"requests": sent["A"] + 1}, "w1": {"requests": sent["B"] - 1}}  # one B request on an A worker
    assert model_check(trace, results, wrong, {"A": ("u0",), "B": ("u1",)}, urls)["B"]["served_by_its_workers"] == sent["B"] - 1
