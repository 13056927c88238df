"""The shared deterministic tokenizer and chat template."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from sim import tokenizer
from sim.tokenizer import (
    BOS,
    END_HEADER,
    EOT,
    START_HEADER,
    OutputStream,
    apply_chat_template,
    decode,
    encode,
)


def test_encoding_is_stable_across_processes():
    text = "The quick brown fox, 12345 internationalization!"
    here = encode(text)
    there = subprocess.run(
        [sys.executable, "-c", f"from sim.tokenizer import encode; print(encode({text!r}))"],
        capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).resolve().parents[2],
    ).stdout.strip()
    assert str(here) == there


def test_pieces_words_digits_punctuation_and_long_words():
    assert len(encode("hello world")) == 2
    assert len(encode("12345")) == 2  # digits in runs of up to 3
    assert len(encode("a, b.")) == 4
    assert len(encode("internationalization")) == 5  # 20 letters in 4-letter chunks
    assert encode("hello   world") == encode("hello world")
    assert all(0 <= t < tokenizer.NUM_REGULAR for t in encode("anything at all ☃"))


def test_chat_template_wraps_every_message_in_order_with_role_markers():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = apply_chat_template(msgs)
    expected = (
        [BOS]
        + [START_HEADER] + encode("system") + [END_HEADER] + encode("be brief") + [EOT]
        + [START_HEADER] + encode("user") + [END_HEADER] + encode("hi") + [EOT]
        + [START_HEADER] + encode("assistant") + [END_HEADER]
    )
    assert ids == expected
    generation_prompt = 2 + len(encode("assistant"))
    assert apply_chat_template(msgs, add_generation_prompt=False) == expected[:-generation_prompt]


def test_chat_template_accepts_content_part_lists():
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}]
    assert apply_chat_template(parts) == apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_longer_conversation_extends_the_shorter_ones_ids():
    turn1 = [{"role": "user", "content": "q1"}]
    turn2 = turn1 + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    ids1 = apply_chat_template(turn1)
    ids2 = apply_chat_template(turn2)
    assert ids2[: len(ids1)] == ids1


def test_generated_text_retokenizes_to_the_generated_ids():
    out = OutputStream([1, 2, 3], seed=7)
    ids = [out.next_token() for _ in range(200)]
    assert encode(decode(ids)) == ids


def test_output_depends_on_prompt_and_seed_only():
    a = [OutputStream([5, 6], 0).next_token() for _ in range(1)]
    b = [OutputStream([5, 6], 0).next_token() for _ in range(1)]
    s1, s2 = OutputStream([5, 6], 0), OutputStream([5, 6], 1)
    assert a == b
    assert [s1.next_token() for _ in range(20)] != [s2.next_token() for _ in range(20)]
