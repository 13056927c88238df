"""The benchmark's workload generators: seeded determinism, shapes, multi-turn history."""

from __future__ import annotations

import os
import statistics

import pytest

from bench.workloads import Session, Turn, build_messages, make_trace, multi_turn, no_sharing, shared_prefix, trace_digest
from sim import tokenizer


def test_same_seed_same_trace_other_seed_other_text():
    for name in ("shared_prefix", "multi_turn", "no_sharing"):
        a = make_trace(name, 7, 10.0, 2.0)
        b = make_trace(name, 7, 10.0, 2.0)
        c = make_trace(name, 8, 10.0, 2.0)
        assert a == b and trace_digest(a) == trace_digest(b)
        assert trace_digest(a) != trace_digest(c)
        # different seeds share no prompt text (no accidental cache hits across trials)
        texts_a = {s.system for s in a.sessions} | {t.user for s in a.sessions for t in s.turns}
        texts_c = {s.system for s in c.sessions} | {t.user for s in c.sessions for t in s.turns}
        assert not (texts_a - {None}) & (texts_c - {None})


def test_unknown_workload_is_an_error():
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("nope", 1, 1.0, 1.0)


def test_shared_prefix_shape():
    tr = shared_prefix(3, rate=20.0, duration_s=4.0, groups=4, system_tokens=300, question_tokens=20, output_tokens=5)
    assert tr.num_requests == 80
    assert tr.params["prompts_per_group"] == 20
    systems = {s.group: s.system for s in tr.sessions}
    assert sorted(systems) == [0, 1, 2, 3]
    assert len(set(systems.values())) == 4  # one long system prompt per group …
    for s in tr.sessions:
        assert s.system == systems[s.group]  # … shared by every prompt of the group
        assert len(s.turns) == 1 and s.turns[0].max_tokens == 5
    questions = [s.turns[0].user for s in tr.sessions]
    assert len(set(questions)) == len(questions)  # distinct questions
    # groups are interleaved, not in blocks
    first_half = {s.group for s in tr.sessions[:20]}
    assert len(first_half) >= 3
    # token counts are what the engine sees (one token per pseudo-word)
    ids = tokenizer.apply_chat_template(build_messages(tr.sessions[0], 0, []))
    assert 300 + 20 <= len(ids) <= 300 + 20 + 20
    # the engine sees a common prefix of at least the system prompt for two prompts of a group
    g = tr.sessions[0].group
    other = next(s for s in tr.sessions[1:] if s.group == g)
    a = tokenizer.apply_chat_template(build_messages(tr.sessions[0], 0, []))
    b = tokenizer.apply_chat_template(build_messages(other, 0, []))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 300


def test_poisson_arrivals_match_the_rate():
    tr = no_sharing(1, rate=50.0, duration_s=40.0, prompt_tokens=10)
    starts = [s.start_s for s in tr.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50.0, rel=0.15)  # exponential: sd == mean


def test_no_sharing_prompts_are_unique_from_the_first_page():
    tr = no_sharing(2, rate=10.0, duration_s=3.0, prompt_tokens=64)
    first_pages = {tuple(tokenizer.apply_chat_template(build_messages(s, 0, []))[:16]) for s in tr.sessions}
    assert len(first_pages) == len(tr.sessions)
    assert all(s.system is None for s in tr.sessions)


def test_multi_turn_repeats_history_including_replies():
    tr = multi_turn(5, rate=9.0, duration_s=3.0, turns=3, context_tokens=50, user_tokens=8, output_tokens=4, think_s=0.5)
    assert tr.num_requests == 27 and len(tr.sessions) == 9  # rate counts every turn
    s = tr.sessions[0]
    assert s.turns[0].gap_s == 0.0 and all(t.gap_s > 0 for t in s.turns[1:])
    replies = [" car saw not king", " the of and to"]
    m0 = build_messages(s, 0, [])
    m1 = build_messages(s, 1, replies[:1])
    m2 = build_messages(s, 2, replies)
    assert [m["role"] for m in m2] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m2[:len(m1)] == m1[:-1] + [m1[-1]] and m1[:len(m0)] == m0  # every turn extends the previous one
    assert m2[2]["content"] == replies[0] and m2[4]["content"] == replies[1]  # replies exactly as received
    # the engine sees turn k's whole prompt plus its reply as a prefix of turn k+1
    ids1 = tokenizer.apply_chat_template(m1, add_generation_prompt=False)
    ids2 = tokenizer.apply_chat_template(m2)
    assert ids2[: len(ids1)] == ids1
    # conversations do not share their context
    assert len({x.system for x in tr.sessions}) == len(tr.sessions)


def test_build_messages_needs_the_earlier_replies():
    s = Session("x", 0.0, None, (Turn("a", 1), Turn("b", 1, 0.1)))
    with pytest.raises(ValueError):
        build_messages(s, 1, [])
    assert build_messages(s, 0, []) == [{"role": "user", "content": "a"}]


# ---------------------------------------------------------------------------- the Mooncake replay

def _write_trace(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


_ROWS = [  # (ms, input tokens, output tokens, hash ids) shaped like the trace's rows
    {"timestamp": 0, "input_length": 1100, "output_length": 80, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1300, "output_length": 16, "hash_ids": [0, 1, 3]},
    {"timestamp": 700, "input_length": 700, "output_length": 400, "hash_ids": [0, 4]},
    {"timestamp": 2000, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 2]},
    {"timestamp": 4000, "input_length": 300, "output_length": 30, "hash_ids": [5]},
]


def _common_prefix(a, b) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def test_mooncake_equal_hash_prefixes_iff_equal_token_prefixes(tmp_path):
    from bench.workloads import mooncake

    path = _write_trace(tmp_path / "t.jsonl", _ROWS)
    tr = mooncake(3, rate=2.5, duration_s=2.0, length_scale=1 / 16, path=path)
    assert tr.num_requests == 5 and tr.params["block_tokens"] == 32
    toks = [tokenizer.encode(s.turns[0].user) for s in tr.sessions]
    # lengths: input scaled by 1/16 (ceil), outputs by the same factor, at least one token
    assert [len(t) for t in toks] == [69, 82, 44, 96, 19]
    assert [s.turns[0].max_tokens for s in tr.sessions] == [5, 1, 25, 1, 2]
    for i, ri in enumerate(_ROWS):
        for j, rj in enumerate(_ROWS):
            shared = _common_prefix(ri["hash_ids"], rj["hash_ids"])
            common = _common_prefix(toks[i], toks[j])
            full = min(len(toks[i]), len(toks[j]))
            if shared == min(len(ri["hash_ids"]), len(rj["hash_ids"])):
                assert common == full  # one is a prefix of the other, block for block
            else:  # equal through the shared blocks, different within the first tokens of the next
                assert shared * 32 <= common < shared * 32 + 3


def test_mooncake_time_compression_keeps_the_arrival_pattern(tmp_path):
    from bench.workloads import mooncake

    path = _write_trace(tmp_path / "t.jsonl", _ROWS)
    tr = mooncake(1, rate=2.5, duration_s=2.0, path=path)  # 5 requests over 2 s: 4 s of trace → 1.6 s
    starts = [s.start_s for s in tr.sessions]
    assert tr.params["time_compression"] == pytest.approx(2.5)
    assert starts == pytest.approx([0.0, 0.2, 0.28, 0.8, 1.6])


def test_mooncake_seeds_share_nothing_and_slices_are_checked(tmp_path):
    from bench.workloads import mooncake

    path = _write_trace(tmp_path / "t.jsonl", _ROWS)
    a = mooncake(1, rate=2.5, duration_s=2.0, path=path)
    b = mooncake(2, rate=2.5, duration_s=2.0, path=path)
    ta = tokenizer.encode(a.sessions[0].turns[0].user)
    tb = tokenizer.encode(b.sessions[0].turns[0].user)
    assert _common_prefix(ta, tb) < 6
    with pytest.raises(ValueError, match="rows from"):
        mooncake(1, rate=10.0, duration_s=2.0, path=path)  # 20 rows wanted, 5 there
    bad = _write_trace(tmp_path / "bad.jsonl", [{**_ROWS[0], "hash_ids": [0]}])
    with pytest.raises(ValueError, match="hash ids for 1100 tokens"):
        mooncake(1, rate=1.0, duration_s=1.0, path=bad)


def test_mooncake_real_trace_keeps_its_sharing():
    """On the shipped trace: the slice's shared-prefix structure survives the synthesis."""
    from bench.workloads import load_mooncake, mooncake, mooncake_path

    if not os.path.exists(mooncake_path()):
        pytest.fail(f"the Mooncake trace is missing at {mooncake_path()}")
    rows = load_mooncake()[:200]
    tr = mooncake(1, rate=20.0, duration_s=10.0)
    toks = [tokenizer.encode(s.turns[0].user) for s in tr.sessions]
    bt = tr.params["block_tokens"]
    for i in range(0, 200, 7):
        for j in range(i + 1, 200, 13):
            shared = _common_prefix(rows[i]["hash_ids"], rows[j]["hash_ids"])
            common = _common_prefix(toks[i], toks[j])
            if shared < min(len(rows[i]["hash_ids"]), len(rows[j]["hash_ids"])):
                assert shared * bt <= common < shared * bt + 3


def test_multi_lora_shares_one_system_prompt_and_names_zipf_popular_adapters_in_sglangs_form():
    from collections import Counter

    from bench.workloads import LORA_BASE, make_trace

    t = make_trace("multi_lora", 3, 20.0, 20.0, adapters=8, zipf_s=1.0, system_tokens=64, question_tokens=8)
    assert len({s.system for s in t.sessions}) == 1  # one prompt for all: only the adapter tells them apart
    counts = Counter(s.model for s in t.sessions)
    assert set(counts) <= {f"{LORA_BASE}:lora{k}" for k in range(8)}
    assert counts[f"{LORA_BASE}:lora0"] > 2 * counts[f"{LORA_BASE}:lora7"]  # Zipf: the first is the most popular
    assert all(s.model == f"{LORA_BASE}:lora{s.group}" for s in t.sessions)
    assert make_trace("multi_lora", 3, 20.0, 20.0, adapters=8, system_tokens=64, question_tokens=8) == \
        make_trace("multi_lora", 3, 20.0, 20.0, adapters=8, system_tokens=64, question_tokens=8)
