"""Request bodies the sim accepts or refuses with a 400 that names the field."""

from __future__ import annotations

import pytest

from sim import protocol, tokenizer
from sim.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest, parse_body


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "x"}]}', "messages.0.role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
    ],
)
def test_bad_chat_bodies_raise_bad_request_naming_the_field(raw, param):
    with pytest.raises(BadRequest) as info:
        parse_body(raw, ChatCompletionRequest)
    assert info.value.param == param or (param and info.value.param.startswith(param))


def test_chat_body_tokenizes_with_the_shared_template_and_ignores_unknown_fields():
    body = parse_body(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.3, "foo": 1}',
        ChatCompletionRequest,
    )
    assert protocol.chat_input_ids(body) == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_completion_prompt_forms():
    text = parse_body(b'{"prompt": "hello"}', CompletionRequest)
    assert protocol.completion_input_ids(text) == tokenizer.encode("hello", add_bos=True)
    assert text.max_tokens == 16
    ids = parse_body(b'{"prompt": [5, 6, 7]}', CompletionRequest)
    assert protocol.completion_input_ids(ids) == [5, 6, 7]
    one = parse_body(b'{"prompt": ["hello"]}', CompletionRequest)
    assert protocol.completion_input_ids(one) == protocol.completion_input_ids(text)
    many = parse_body(b'{"prompt": ["a", "b"]}', CompletionRequest)
    with pytest.raises(BadRequest, match="batched"):
        protocol.completion_input_ids(many)
    bad_ids = parse_body(b'{"prompt": [-1]}', CompletionRequest)
    with pytest.raises(BadRequest, match="token ids"):
        protocol.completion_input_ids(bad_ids)


def test_generate_needs_text_or_input_ids():
    with pytest.raises(BadRequest, match="text or input_ids"):
        protocol.generate_input_ids(parse_body(b"{}", GenerateRequest))
    body = parse_body(b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}', GenerateRequest)
    assert protocol.generate_input_ids(body) == [1, 2]
    assert body.sampling_params.max_new_tokens == 3
    with pytest.raises(BadRequest):
        parse_body(b'{"text": "x", "sampling_params": {"max_new_tokens": -2}}', GenerateRequest)
