"""How a chat request becomes the engine's token ids behind Ray Serve LLM (no Ray): what kvroute's
request router must reproduce for exact prefix mode.

Ray's `SGLangServer.chat` renders the chat template to TEXT (`tokenizer.apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)`) and hands that text to `engine.async_generate`; SGLang's
TokenizerManager then tokenizes it like any text prompt, WITH special tokens (`tokenizer(text)`): the
template's special-token strings map to their ids, and a tokenizer that adds BOS adds one more in
front of a template that already starts with it. SGLang's own HTTP server tokenizes the template
directly instead (one BOS) — the path `serve_app.prompt_tokens` reproduces for kvroute's own router
and for pass-through replicas. `rendered_chat_ids` is the Serve LLM path, for any tokenizer with
`render(messages, tools) -> str` and `text(str) -> ids` (`prompt_tokens.HfTokenizer`,
`SimChatTokenizer`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from serve_app.prompt_tokens import load_tokenizer
from sim import tokenizer

_SPECIAL_IDS = {text: tid for tid, text in tokenizer.SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in _SPECIAL_IDS) + ")")


class SimChatTokenizer:
    """The simulator's tokenizer (`sim.tokenizer`) in the shape `SGLangServer` and SGLang call (a
    Hugging Face tokenizer's), with an HF tokenizer's text semantics: special-token strings in a text
    are their ids, and `add_special_tokens` puts a BOS in front (also before a rendered template's own)."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, **_: Any) -> Any:
        """The sim's Llama-3 shaped template as text (`tokenize=False`, what SGLangServer asks) or ids."""
        if tokenize:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        sp = tokenizer.SPECIAL_TOKENS
        out = [sp[tokenizer.BOS]]
        for m in messages:
            out += [sp[tokenizer.START_HEADER], str(m.get("role", "")), sp[tokenizer.END_HEADER],
                    tokenizer._content_text(m.get("content")), sp[tokenizer.EOT]]
        if add_generation_prompt:
            out += [sp[tokenizer.START_HEADER], "assistant", sp[tokenizer.END_HEADER]]
        return "".join(out)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [tokenizer.BOS] if add_special_tokens else []
        for part in _SPECIAL_RE.split(text):
            if part in _SPECIAL_IDS:
                ids.append(_SPECIAL_IDS[part])
            elif part:
                ids.extend(tokenizer.encode(part))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return tokenizer.decode(ids)

    # the router-side interface (`prompt_tokens.HfTokenizer`'s)
    def render(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        return self.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def text(self, text: str) -> list[int]:
        return self.encode(text)


def serve_tokenizer(spec: str) -> Any:
    """`RouterConfig.tokenizer` → a tokenizer for `rendered_chat_ids` (`none` → None). Raises
    `prompt_tokens.TokenizerError` as `load_tokenizer` does."""
    if spec == "sim":
        return SimChatTokenizer()
    return load_tokenizer(spec)


def rendered_chat_ids(tok: Any, body: Mapping[str, Any]) -> list[int] | None:
    """The ids SGLang computes for a chat `body` that came through Ray Serve LLM's SGLangServer; None
    when the body is not a chat or the template refuses it (the request is then routed approximately)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    try:
        return list(tok.text(tok.render(messages, body.get("tools"))))
    except Exception:
        return None
