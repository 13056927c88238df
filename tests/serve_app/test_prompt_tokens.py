"""Exact mode's tokenizers: a real Hugging Face tokenizer directory (built here with the
`tokenizers` library, no download) and its chat template, rendered like transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.config import RouterConfig
from serve_app.prefix_index import KvEventIndex
from serve_app.prompt_tokens import HfTokenizer, TokenizerError, body_token_ids, load_tokenizer
from serve_app.request_facts import FactsConfig, facts_from_body
from tests.serve_app.test_prefix_index import engine_events

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "you are a careful assistant answer the question what is two plus four hello".split()


def make_tokenizer_dir(d: Path, *, template: str | None = TEMPLATE, jinja_file: str | None = None,
                       named: bool = False) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg: dict = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if template is not None:
        cfg["chat_template"] = [{"name": "default", "template": template}] if named else template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja_file is not None:
        (d / "chat_template.jinja").write_text(jinja_file)
    return d


def ids(words: str) -> list[int]:
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    return [vocab[w] for w in words.split()]


CHAT = [{"role": "system", "content": "you are a careful assistant"},
        {"role": "user", "content": "what is two plus four"}]


def test_chat_is_rendered_by_the_template_then_tokenized_without_extra_specials(tmp_path):
    tok = HfTokenizer(make_tokenizer_dir(tmp_path))
    assert tok.render(CHAT) == ("<s><|system|> you are a careful assistant </s> "
                                "<|user|> what is two plus four </s> <|assistant|>")
    # one BOS (the template's), the eos token from its AddedToken form, the generation prompt
    assert tok.chat(CHAT) == ids("<s> <|system|> you are a careful assistant </s> "
                                 "<|user|> what is two plus four </s> <|assistant|>")
    assert tok.text("hello what is two") == ids("<s> hello what is two")  # plain prompt: BOS added


def test_template_sources_in_transformers_order(tmp_path):
    jinja = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert HfTokenizer(make_tokenizer_dir(tmp_path / "a", jinja_file=jinja)).chat(CHAT) == ids(
        "you are a careful assistant what is two plus four")
    assert HfTokenizer(make_tokenizer_dir(tmp_path / "b", named=True)).chat(CHAT)[0] == 1


def test_loading_errors_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        HfTokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="no chat template"):
        HfTokenizer(make_tokenizer_dir(tmp_path / "nt", template=None))
    with pytest.raises(TokenizerError, match="does not compile"):
        HfTokenizer(make_tokenizer_dir(tmp_path / "bad", template="{% for %}"))
    with pytest.raises(TokenizerError, match="expected 'none', 'sim' or 'hf:<directory>'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValidationError, match="tokenizer.json not found"):
        RouterConfig(tokenizer=f"hf:{tmp_path / 'missing'}")
    assert RouterConfig(tokenizer=f"hf:{make_tokenizer_dir(tmp_path / 'ok')}").tokenizer.startswith("hf:")


def test_the_template_runs_sandboxed_and_a_refusal_costs_only_that_request(tmp_path):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = HfTokenizer(make_tokenizer_dir(tmp_path / "e", template=escape))
    assert body_token_ids(tok, {"messages": CHAT}) is None  # SecurityError inside: refused
    strict = HfTokenizer(make_tokenizer_dir(
        tmp_path / "s", template="{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
                                 "{% endif %}{{ messages[0]['content'] }}"))
    assert body_token_ids(strict, {"messages": CHAT[1:]}) is None
    assert body_token_ids(strict, {"messages": CHAT}) == ids("you are a careful assistant")
    assert body_token_ids(strict, {"prompt": [1, 2, 3]}) is None  # token ids need no tokenizer


def test_exact_index_matches_what_the_engine_cached_for_the_same_chat(tmp_path):
    """The engine caches the token ids of a rendered chat; the router, tokenizing the next turn
    with the same tokenizer and template, finds those blocks in the exact index."""
    tok = HfTokenizer(make_tokenizer_dir(tmp_path))
    block = 4
    engine_ids = tok.chat(CHAT)
    ix = KvEventIndex(block_tokens=block)
    ix.apply("w0", engine_events(engine_ids, block))
    follow_up = CHAT + [{"role": "assistant", "content": "four"}, {"role": "user", "content": "hello"}]
    body = {"messages": follow_up}
    facts = facts_from_body(body, config=FactsConfig(block_tokens=block), token_ids=body_token_ids(tok, body))
    held = ix.overlap(facts.block_hashes)
    # the first turn's ids (up to its generation prompt) are a prefix of the follow-up's
    assert tok.chat(follow_up)[: len(engine_ids)] == engine_ids
    assert held == {"w0": len(engine_ids) // block} and len(engine_ids) // block >= 3
