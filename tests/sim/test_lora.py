"""The sim's LoRA surface is SGLang 0.5.23's (issue 33): flags, routes, /v1/models, errors, cache namespaces.

Expectations were read from 0.5.23's wheel (`serving_base._parse_model_parameter`,
`tokenizer_manager._validate_and_resolve_lora`, `tokenizer_control_mixin.load_lora_adapter`,
`lora_registry`, `http_server.available_models`, `mem_cache/events.py`) and are written out here.
"""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from sim.__main__ import build_parser, config_from_args
from sim.config import EngineConfig, SimConfig
from sim.engine import Engine, run_until_idle
from sim.kv_events import BlockStored, decode_batch, encode_batch
from sim.lora import LoraRegistry, parse_lora_paths, parse_model_parameter
from sim.server import SimServer

SYSTEM = [{"role": "system", "content": "You are a careful assistant. " * 60}]


def chat(model=None, user="hi", **extra):
    body = {"messages": SYSTEM + [{"role": "user", "content": user}], "max_tokens": 2, **extra}
    if model is not None:
        body["model"] = model
    return body


@pytest.fixture
def client():
    srv = SimServer(SimConfig(port=0, model_name="base", lora_paths=("a=/p/a", "b=/p/b"), time_scale=0.01))
    with TestClient(srv.app) as c:
        yield c


def cached(r):
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_lora_paths_parse_as_sglang_does_with_its_deterministic_ids():
    refs = parse_lora_paths(["a=/p/a", "/p/b", '{"lora_name": "c", "lora_path": "/p/c", "pinned": true}'])
    assert [(r.name, r.path, r.pinned) for r in refs] == [("a", "/p/a", False), ("/p/b", "/p/b", False),
                                                          ("c", "/p/c", True)]
    assert refs[0].lora_id == uuid.uuid5(uuid.NAMESPACE_URL, "a\0/p/a").hex


def test_model_parameter_parses_like_serving_base():
    assert parse_model_parameter("base:a", "base") == ("base", "a")
    assert parse_model_parameter("org/m:v1", "org/m:v1") == ("org/m:v1", None)  # the served name itself
    assert parse_model_parameter("org/m:v1:a", "org/m:v1") == ("org/m:v1", "a")  # the served name cut off whole
    assert parse_model_parameter("other:a", "base") == ("other", "a")  # the base part is not checked
    assert parse_model_parameter("a", "base") == ("a", None)  # no colon: the base model
    assert parse_model_parameter("base:", "base") == ("base", None)


def test_cli_flags_are_sglangs():
    args = build_parser().parse_args(["--port", "1", "--lora-paths", "a=/p/a", "b=/p/b", "--max-loras-per-batch", "2"])
    cfg = config_from_args(args)
    assert cfg.lora_enabled and cfg.lora_paths == ("a=/p/a", "b=/p/b") and cfg.max_loras_per_batch == 2
    assert config_from_args(build_parser().parse_args(["--port", "1", "--enable-lora"])).lora_enabled
    assert not config_from_args(build_parser().parse_args(["--port", "1"])).lora_enabled


def test_v1_models_lists_adapters_with_parent(client):
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in data[1:]] == [
        ("a", "/p/a", "base", None), ("b", "/p/b", "base", None)]
    assert data[0]["id"] == "base" and data[0]["parent"] is None


def test_each_adapter_has_its_own_cache_namespace(client):
    assert cached(client.post("/v1/chat/completions", json=chat("base:a"))) == 0
    assert cached(client.post("/v1/chat/completions", json=chat("base:a", user="other"))) > 400
    assert cached(client.post("/v1/chat/completions", json=chat("base:b"))) == 0  # same prompt, other adapter
    assert cached(client.post("/v1/chat/completions", json=chat("base"))) == 0  # the base model's own
    assert cached(client.post("/v1/chat/completions", json=chat("anything"))) > 400  # no colon: base
    assert cached(client.post("/v1/chat/completions", json=chat(lora_path="a", user="third"))) > 400
    # the model's adapter beats lora_path
    assert cached(client.post("/v1/chat/completions", json=chat("base:b", lora_path="a", user="4"))) > 400


def test_an_adapter_never_loaded_is_sglangs_400(client):
    r = client.post("/v1/chat/completions", json=chat("base:zz", stream=True))
    assert r.status_code == 400
    assert r.json() == {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                        "message": "Got LoRA adapter that has never been loaded: zz\n"
                                   "All loaded adapters: dict_keys(['a', 'b'])."}
    r = client.post("/generate", json={"text": "hi", "lora_path": "zz"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Got LoRA adapter that has never")


def test_lora_off_refuses_an_adapter_with_sglangs_message():
    srv = SimServer(SimConfig(port=0, model_name="base", time_scale=0.01))
    with TestClient(srv.app) as c:
        r = c.post("/v1/chat/completions", json=chat("base:a"))
        assert r.status_code == 400 and r.json()["message"].startswith(
            "LoRA adapter 'a' was requested, but LoRA is not enabled.")
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p/a"})
        assert r.status_code == 400 and r.json()["error_message"] == \
            "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        assert len(c.get("/v1/models").json()["data"]) == 1


def test_load_and_unload_routes_answer_lora_update_output(client):
    r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": "/p/c"})
    assert r.status_code == 200 and r.json() == {"rid": None, "http_worker_ipc": None, "success": True,
                                                 "error_message": "",
                                                 "loaded_adapters": {"a": "/p/a", "b": "/p/b", "c": "/p/c"}}
    r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": "/p/c"})
    assert r.status_code == 400 and r.json()["error_message"] == \
        "Failed to load LoRA adapter c because it is already loaded"
    r = client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"b": "/p/b", "c": "/p/c"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base", "b", "c"]
    r = client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 400 and r.json()["error_message"] == \
        "LoRA with name a does not exist. Loaded LoRAs: dict_keys(['b', 'c'])"
    assert client.post("/load_lora_adapter", json={"lora_name": "x"}).status_code == 422


def test_an_unloaded_adapter_is_loaded_again_on_use_as_sglang_does(client):
    client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert client.post("/v1/chat/completions", json=chat("base:a")).status_code == 200
    assert "a" in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_kv_events_name_the_adapter_in_the_map_form_and_hashes_are_namespaced():
    events = []

    class Listener:
        def on_kv_metrics(self, report):
            pass

        def on_kv_events(self, evs):
            events.extend(evs)

    e = Engine(EngineConfig(page_size=4, max_total_num_tokens=64, record_kv_events=True, max_loras_per_batch=8),
               Listener())
    ids = list(range(1, 14))
    e.submit("r1", ids, 1, 0.0, lora_id="L1", lora_name="a")
    e.submit("r2", ids, 1, 0.0)
    t = [0.0]
    run_until_idle(e, lambda: t[0], lambda dt: t.__setitem__(0, t[0] + dt))
    stored = [ev for ev in events if isinstance(ev, BlockStored)]
    by_name = {}
    for ev in stored:
        by_name.setdefault(ev.lora_name, []).extend(ev.block_hashes)
    assert set(by_name) == {"a", None}
    assert not set(by_name["a"]) & set(by_name[None])  # same tokens, other namespace
    assert all(ev.lora_id is None for ev in stored)
    _, back, _ = decode_batch(encode_batch(0.0, stored, 0, "map"))
    assert {ev.lora_name for ev in back} == {"a", None}
    _, back, _ = decode_batch(encode_batch(0.0, stored, 0, "array"))
    assert {ev.lora_name for ev in back} == {None}  # the array form (≤ 0.5.18) has no lora_name


def test_max_loras_per_batch_holds_back_a_third_adapter_but_not_the_queue_behind_it():
    e = Engine(EngineConfig(page_size=4, max_total_num_tokens=4096, max_loras_per_batch=2))
    e.submit("a", [1] * 8, 4, 0.0, lora_id="A")
    e.submit("b", [2] * 8, 4, 0.0, lora_id="B")
    e.submit("c", [3] * 8, 4, 0.0, lora_id="C")
    e.submit("a2", [4] * 8, 4, 0.0, lora_id="A")
    batch = e.schedule(0.0)
    assert [r.rid for r in batch.reqs] == ["a", "b", "a2"]  # C waits; A's second request goes past it
    assert [r.rid for r in e.waiting] == ["c"]


def test_registry_without_lora_lists_no_adapters():
    assert LoraRegistry(False, parse_lora_paths(["a=/p"])).model_cards("base", 0) == []
