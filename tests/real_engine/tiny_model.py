"""A tiny Llama model made on the spot for the real-engine lane: deterministic, no network, nothing
from a model hub.

    python -m tests.real_engine.tiny_model DIR      # (in the real-engine venv) writes DIR, prints it

- tokenizer: a byte-level BPE (`tokenizers`) trained on a fixed corpus generated here from a seeded
  PRNG over a fixed word list, vocabulary 1,024, special tokens `<s>` `</s>` `<|system|>` `<|user|>`
  `<|assistant|>`; its post-processor adds `<s>` to plain text (as SGLang's `encode` does for
  /v1/completions and /generate) and a chat template in `tokenizer_config.json` that starts with it.
- model: `LlamaForCausalLM`, 2 layers, hidden 128, 4 heads (2 KV heads), context 2,048, seeded
  random float32 weights; the lm_head row of `</s>` is zero, so a greedy reply never stops early
  (random logits are almost always above 0 somewhere) — outputs have exactly max_tokens tokens.

The same DIR is made byte for byte on every run (`model_digest` tells); `ensure(DIR)` makes it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024
CONTEXT = 2048
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_WORDS = (
    "the a an of to in is was for on with as by at from that this it be are or and not have has had "
    "cache prefix token block page worker router engine request reply stream batch queue prefill decode "
    "memory pool evict flush radix tree hash event metric load slot model layer head vector matrix "
    "server client socket port route policy latency throughput fleet node cluster actor state live idle "
    "down health probe timer clock second minute hour day week year time space river mountain forest "
    "city road bridge house garden window door table chair book paper letter word line story music song "
    "red green blue yellow black white small large quick slow early late new old first last next other "
    "one two three four five six seven eight nine ten hundred thousand zero alpha beta gamma delta"
).split()


def corpus(lines: int = 4000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 9999)))
        line = " ".join(words)
        if rng.random() < 0.5:
            line = line.capitalize() + rng.choice([".", "?", "!", ",", ";", ":"])
        out.append(line)
    return out


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def make(directory: str | os.PathLike) -> Path:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>",
        model_max_length=CONTEXT, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(d)
    # one place for the template (SGLang/transformers and kvroute's hf: tokenizer read either)
    cfg_file = d / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (d / "chat_template.jinja").unlink(missing_ok=True)

    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
    )
    config.dtype = "float32"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # a fixed init, independent of transformers' init scheme
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        model.lm_head.weight[eos].zero_()
    model.save_pretrained(d, safe_serialization=True)
    (d / ".kvroute-tiny-model").write_text(model_digest(d) + "\n")
    return d


def model_digest(directory: str | os.PathLike) -> str:
    """sha256 over the files that define the model (tokenizer, config, weights)."""
    d = Path(directory)
    h = hashlib.sha256()
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        h.update(name.encode())
        h.update((d / name).read_bytes())
    return h.hexdigest()


def ensure(directory: str | os.PathLike) -> Path:
    d = Path(directory)
    stamp = d / ".kvroute-tiny-model"
    if stamp.is_file() and (d / "model.safetensors").is_file():
        return d
    return make(d)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.real_engine.tiny_model DIR")
    print(make(sys.argv[1]))
