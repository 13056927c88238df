"""Request bodies → the token ids the engine will see, for exact prefix mode.

Exact mode matches prompts against the blocks the engines report caching (SGLang KV events carry
token ids), so the router must tokenize a prompt exactly as the engine does: same tokenizer, same
chat template. `RouterConfig.tokenizer` picks how:

- `none` — no tokenization; prefix affinity stays approximate (text blocks).
- `sim` — the simulator's tokenizer and chat template (`sim.tokenizer`).
- `hf:<dir>` — a Hugging Face tokenizer directory, the files SGLang loads with the model:
  `tokenizer.json` (a fast tokenizer, read with the `tokenizers` library) and the chat template
  (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`, where a list of named
  templates uses `default`). Like transformers' `apply_chat_template` (what SGLang calls), the
  template is rendered in a sandboxed Jinja environment with `trim_blocks`/`lstrip_blocks` and the
  tokenizer's special tokens, then tokenized without adding special tokens (the template carries
  them); plain-text prompts are tokenized with them (SGLang's `encode` adds BOS).

Loading fails at start with a message naming the file, never per request.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Sequence


class TokenizerError(ValueError):
    """The configured tokenizer cannot be loaded."""


class PromptTokenizer(Protocol):
    def chat(self, messages: list[Any], tools: Any = None) -> list[int]: ...

    def text(self, text: str) -> list[int]: ...


class SimTokenizer:
    """The simulated engine's tokenizer and Llama-3-shaped chat template."""

    def chat(self, messages: list[Any], tools: Any = None) -> list[int]:
        from sim import tokenizer

        return list(tokenizer.apply_chat_template(messages))

    def text(self, text: str) -> list[int]:
        from sim import tokenizer

        return tokenizer.encode(text, add_bos=True)


def _token_text(v: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class HfTokenizer:
    """A Hugging Face tokenizer directory: `tokenizer.json` + its chat template."""

    def __init__(self, directory: str | Path) -> None:
        d = Path(directory).expanduser()
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"tokenizer hf:{directory}: {tok_file} not found (a fast tokenizer's "
                                 "tokenizer.json, as in the model's Hugging Face directory)")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - the dependency is declared
            raise TokenizerError("tokenizer hf:… needs the `tokenizers` package (pip install 'kvroute[hf]')") from exc
        try:
            self._tok = Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise TokenizerError(f"tokenizer hf:{directory}: cannot read {tok_file}: {exc}") from exc
        cfg: dict[str, Any] = {}
        cfg_file = d / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"tokenizer hf:{directory}: {cfg_file} is not JSON: {exc}") from exc
            if not isinstance(cfg, dict):
                raise TokenizerError(f"tokenizer hf:{directory}: {cfg_file} is not a JSON object")
        template = self._template(d, cfg, directory)
        self._special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                                        "cls_token", "mask_token") if (t := _token_text(cfg.get(k))) is not None}
        self._render = self._compile(template, directory)

    @staticmethod
    def _template(d: Path, cfg: dict[str, Any], directory: Any) -> str:
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        t = cfg.get("chat_template")
        if isinstance(t, list):  # named templates
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            t = named.get("default")
        if not isinstance(t, str) or not t:
            raise TokenizerError(f"tokenizer hf:{directory}: no chat template (chat_template.jinja, or "
                                 "chat_template in tokenizer_config.json)")
        return t

    @staticmethod
    def _compile(template: str, directory: Any) -> Any:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(Extension):
            """transformers' `{% generation %}` marks assistant text for masks; here it renders as is."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body, lineno=lineno)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(template).render
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"tokenizer hf:{directory}: the chat template does not compile: {exc}") from exc

    def render(self, messages: list[Any], tools: Any = None) -> str:
        """The chat template's text for these messages, generation prompt included."""
        return self._render(messages=messages, tools=tools, add_generation_prompt=True, **self._special)

    def chat(self, messages: list[Any], tools: Any = None) -> list[int]:
        return self._tok.encode(self.render(messages, tools), add_special_tokens=False).ids

    def text(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids


def load_tokenizer(spec: str) -> PromptTokenizer | None:
    """`none` → None; `sim`; `hf:<dir>`. Raises TokenizerError naming what is wrong."""
    if spec == "none":
        return None
    if spec == "sim":
        return SimTokenizer()
    if spec.startswith("hf:") and len(spec) > 3:
        return HfTokenizer(spec[3:])
    raise TokenizerError(f"tokenizer {spec!r}: expected 'none', 'sim' or 'hf:<directory>'")


def body_token_ids(tok: PromptTokenizer, body: Any) -> Sequence[int] | None:
    """The prompt's token ids as the engine will see them; None when the body has no text prompt
    (token-id prompts need no tokenizer) or cannot be rendered (facts_from_body then reports a
    malformed body precisely; a template that refuses a body leaves that request approximate)."""
    if not isinstance(body, dict):
        return None
    try:
        if isinstance(body.get("messages"), list):
            return tok.chat(body["messages"], body.get("tools"))
        for key in ("prompt", "text"):
            if isinstance(body.get(key), str):
                return tok.text(body[key])
    except Exception:
        return None
    return None
