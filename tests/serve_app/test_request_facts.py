"""Request bodies → RouteRequest: the whole conversation is the cache key, cheaply hashed in blocks."""

from __future__ import annotations


import pytest

from serve_app.prefix_index import hash_token_blocks
from serve_app.request_facts import FactsConfig, InvalidRequestBody, facts_from_body

SYSTEM = "You are a meticulous assistant. " * 40  # ~1.3k chars, ~20 blocks of 64 chars


def chat(*msgs: tuple[str, object], **extra) -> dict:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs], **extra}


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_chat_prompt_holds_every_message_in_order_with_roles():
    r = facts_from_body(chat(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")))
    text = r.prompt
    assert text.index("system\nS") < text.index("user\nU1") < text.index("assistant\nA1") < text.index("user\nU2")


def test_chats_sharing_only_the_first_message_get_different_hashes_beyond_it():
    a = facts_from_body(chat(("system", SYSTEM), ("user", "What is the capital of France? " * 10)))
    b = facts_from_body(chat(("system", SYSTEM), ("user", "Write a sonnet about the sea. " * 10)))
    shared = common_prefix(a.block_hashes, b.block_hashes)
    assert shared >= len(SYSTEM) // 64 - 1  # the system prompt's blocks match
    assert shared < min(len(a.block_hashes), len(b.block_hashes))  # the rest does not
    assert a.block_hashes[-1] != b.block_hashes[-1]


def test_a_later_turn_extends_the_earlier_turns_blocks():
    t1 = chat(("system", SYSTEM), ("user", "first question " * 20))
    t2 = chat(("system", SYSTEM), ("user", "first question " * 20), ("assistant", "answer " * 30),
              ("user", "second question " * 20))
    a, b = facts_from_body(t1), facts_from_body(t2)
    assert b.prompt.startswith(a.prompt)
    assert b.block_hashes[: len(a.block_hashes)] == a.block_hashes
    assert len(b.block_hashes) > len(a.block_hashes)


def test_a_later_turn_with_non_ascii_text_still_extends_an_ascii_turns_blocks():
    """(ASCII prompts are cut as bytes, others as characters: the same blocks hash the same either way.)"""
    t1 = chat(("system", SYSTEM), ("user", "first question " * 20))
    t2 = chat(("system", SYSTEM), ("user", "first question " * 20), ("assistant", "réponse naïve — ünïcode " * 12),
              ("user", "second question " * 20))
    a, b = facts_from_body(t1), facts_from_body(t2)
    assert a.prompt.isascii() and not b.prompt.isascii()
    assert b.block_hashes[: len(a.block_hashes)] == a.block_hashes
    assert len(set(b.block_hashes)) == len(b.block_hashes) > len(a.block_hashes)
    swapped = facts_from_body(chat(("system", SYSTEM), ("user", "first question " * 20),
                                   ("assistant", "ünïcode réponse naïve — " * 12), ("user", "second question " * 20)))
    assert swapped.block_hashes[-1] != b.block_hashes[-1]


def test_list_of_parts_content_is_part_of_the_prompt():
    a = facts_from_body(chat(("user", [{"type": "text", "text": "look at "}, {"type": "text", "text": "this"},
                                      {"type": "image_url", "image_url": {"url": "http://x/1.png"}}])))
    b = facts_from_body(chat(("user", [{"type": "text", "text": "look at this"},
                                      {"type": "image_url", "image_url": {"url": "http://x/2.png"}}])))
    assert "look at this" in a.prompt and "1.png" in a.prompt and "2.png" in b.prompt
    assert a.prompt != b.prompt


def test_tools_and_tool_calls_shape_the_prompt():
    base = [("user", "weather?")]
    with_tools = facts_from_body(chat(*base, tools=[{"type": "function", "function": {"name": "get_weather"}}]))
    assert "get_weather" in with_tools.prompt
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]}
    r = facts_from_body({"messages": [{"role": "user", "content": "x"}, call,
                                      {"role": "tool", "content": "42", "tool_call_id": "1"}]})
    assert "tool_calls" in r.prompt and "42" in r.prompt


def test_token_estimate_max_tokens_and_block_count():
    r = facts_from_body(chat(("user", "a" * 4000), max_tokens=77))
    assert 1000 <= r.prompt_tokens <= 1010
    assert r.max_tokens == 77
    assert r.prompt_blocks == -(-r.prompt_tokens // 16)
    assert len(r.block_hashes) == len(r.prompt) // 64
    assert facts_from_body(chat(("user", "x"), max_completion_tokens=9, max_tokens=5)).max_tokens == 9


def test_completion_prompts_text_batches_and_token_ids():
    assert facts_from_body({"prompt": "hello " * 100, "max_tokens": 5}).prompt_tokens == 150
    batch = facts_from_body({"prompt": ["first " * 50, "second"]})
    assert batch.prompt.startswith("first ")
    ids = list(range(100))
    r = facts_from_body({"prompt": ids})
    assert r.prompt_tokens == 100 and r.token_ids == tuple(ids)
    assert list(r.block_hashes) == hash_token_blocks(ids, 16)  # 6 full blocks, tail ignored
    assert len(r.block_hashes) == 6


def test_sglang_generate_bodies():
    r = facts_from_body({"text": "hi " * 40, "sampling_params": {"max_new_tokens": 12}})
    assert r.max_tokens == 12 and r.prompt.startswith("hi ")
    r = facts_from_body({"input_ids": [1, 2, 3] * 20})
    assert r.prompt_tokens == 60 and len(r.block_hashes) == 3


def test_exact_mode_hashes_supplied_token_ids_with_the_given_hasher():
    ids = list(range(64))
    r = facts_from_body(chat(("user", "ignored for hashing")), token_ids=ids, hasher=lambda p, t: p + sum(t))
    assert r.token_ids == tuple(ids) and r.prompt_tokens == 64
    assert r.block_hashes == tuple(hash_token_blocks(ids, 16, lambda p, t: p + sum(t)))


@pytest.mark.parametrize("body, field", [
    ({}, "body"),
    ([], "body"),
    ({"model": "m"}, "body"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"text": None}, "text"),
])
def test_bodies_without_a_usable_prompt_are_refused_naming_the_field(body, field):
    with pytest.raises(InvalidRequestBody) as e:
        facts_from_body(body)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_hash_blocks_are_capped_and_configurable():
    cfg = FactsConfig(block_tokens=4, chars_per_token=2, max_blocks=10)
    r = facts_from_body({"prompt": "z" * 1000}, config=cfg)
    assert r.block_tokens == 4 and len(r.block_hashes) == 10 and r.prompt_tokens == 500
    with pytest.raises(ValueError):
        FactsConfig(block_tokens=0)
