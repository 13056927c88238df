"""Request body (OpenAI chat/completion or SGLang /generate) → `RouteRequest`, computed once per request.

The prompt is the whole conversation as the engine will see it — every message in order, role and
content, list-of-parts content, tool calls, and the tool definitions the chat template renders
first — never just the first message (sglang #26263: two chats sharing a first message are not the
same prefix). Serialisation is append-only: a conversation extended by more turns starts with the
exact text of the shorter one, so a multi-turn chat keeps matching its earlier blocks.

Block hashes: the prompt is cut into chunks of `block_tokens × chars_per_token` characters (≈ one
engine page); chunk i's hash is XOR-accumulated over (position, chunk) hashes of chunks 0..i, so
equal hashes mean equal prefixes. The per-block work runs in C (cutting, hashing, accumulation;
an ASCII prompt is cut as bytes by one `struct` call): ≈ 0.05 ms for a 4k-token chat on a 2.2 GHz VM
(bench/decision.py). Python's string hash is keyed
per process, so hashes are comparable only inside one router process — which is where the
approximate prefix index lives. When the body carries token ids
(or `hasher`/token ids are supplied for exact mode), blocks are hashed from tokens instead
(`serve_app.prefix_index.hash_token_blocks`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, count
from operator import xor
from typing import Any, Iterable, Mapping, Sequence

from serve_app.policies.base import RouteRequest
from serve_app.prefix_index import BlockHasher, hash_token_blocks


class InvalidRequestBody(ValueError):
    """The body has no usable prompt (the router answers 400). `field` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class FactsConfig:
    """How prompts become blocks."""

    block_tokens: int = 16
    """Tokens per block; match the engines' --page-size (RouterConfig.block_size)."""
    chars_per_token: int = 4
    """Characters per token for text prompts (estimate; English text with common tokenizers)."""
    max_blocks: int = 8192
    """Hash at most this many leading blocks (128k tokens at 16): bounds index memory and time."""

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.chars_per_token < 1 or self.max_blocks < 1:
            raise ValueError("FactsConfig values must be ≥ 1")


DEFAULT_FACTS = FactsConfig()
_MSG_END = "\x1e"  # record separator: cannot be confused with ordinary text


def facts_from_body(
    body: Any,
    *,
    config: FactsConfig = DEFAULT_FACTS,
    token_ids: Sequence[int] | None = None,
    hasher: BlockHasher | None = None,
) -> RouteRequest:
    """The routing facts of one request body.

    Chat (`messages`), completion (`prompt`: str, list of str, token ids or lists of them) and
    SGLang `/generate` (`text` or `input_ids`, `sampling_params.max_new_tokens`) are recognised.
    `token_ids` (the prompt tokenized like the engine, exact mode) overrides text hashing; `hasher`
    is then the per-block hash (default `hash_token_blocks`'). Raises `InvalidRequestBody`.
    """
    if not isinstance(body, Mapping):
        raise InvalidRequestBody("body", f"must be a JSON object, got {type(body).__name__}")
    ids: Sequence[int] | None = token_ids
    if "messages" in body:
        prompt = chat_prompt(body["messages"], body.get("tools"))
        max_tokens = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    elif "prompt" in body:
        prompt, body_ids = _completion_prompt(body["prompt"], "prompt")
        ids = ids if ids is not None else body_ids
        max_tokens = _int_field(body, "max_tokens")
    elif "text" in body or "input_ids" in body:
        key = "text" if "text" in body else "input_ids"
        prompt, body_ids = _completion_prompt(body[key], key)
        ids = ids if ids is not None else body_ids
        sp = body.get("sampling_params")
        max_tokens = _int_field(sp, "max_new_tokens") if isinstance(sp, Mapping) else 0
    else:
        raise InvalidRequestBody(
            "body", "no prompt: expected 'messages' (chat), 'prompt' (completion), "
            "or 'text'/'input_ids' (/generate)"
        )
    bt = config.block_tokens
    if ids is not None:
        ids = tuple(ids)
        hashes = hash_token_blocks(ids[: bt * config.max_blocks], bt, hasher)
        return RouteRequest(prompt, len(ids), max_tokens, tuple(hashes), bt, ids)
    chunk = bt * config.chars_per_token
    tokens = -(-len(prompt) // config.chars_per_token)
    return RouteRequest(prompt, tokens, max_tokens, text_block_hashes(prompt, chunk, config.max_blocks), bt)


def text_block_hashes(text: str, chunk_chars: int, max_blocks: int = 1 << 30) -> tuple[int, ...]:
    """Chained hashes of the full `chunk_chars`-sized chunks of `text` (a partial tail is not a block)."""
    n = min(len(text) // chunk_chars, max_blocks)
    if n <= 0:
        return ()
    if text.isascii():  # (a flag of the string: O(1))
        # one C call cuts the chunks, as bytes (a third of the cost of slicing the string chunk by
        # chunk); an ASCII string hashes like its bytes, so the hashes are the ones below
        chunks: Iterable[tuple[Any]] = _chunker(chunk_chars).iter_unpack(text[: n * chunk_chars].encode("ascii"))
    else:
        ends = range(chunk_chars, (n + 1) * chunk_chars, chunk_chars)
        # (1-tuples, like `iter_unpack`'s: a conversation that turns non-ASCII keeps its ASCII blocks)
        chunks = zip(map(text.__getitem__, map(slice, range(0, n * chunk_chars, chunk_chars), ends)))
    return tuple(accumulate(map(hash, zip(count(), chunks)), xor))


@lru_cache(maxsize=64)
def _chunker(chunk_chars: int) -> struct.Struct:
    return struct.Struct(f"{chunk_chars}s")


def chat_prompt(messages: Any, tools: Any = None) -> str:
    """The conversation serialised in order: tools first (templates render them there), then per
    message its role, name, content (strings and list-of-parts) and tool calls."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestBody("messages", "must be a non-empty list of messages")
    out: list[str] = []
    if tools:
        out.append("tools\n" + _canon(tools) + _MSG_END)
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestBody(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequestBody(f"messages[{i}].role", "must be a string")
        head = role if not m.get("name") else f"{role}:{m.get('name')}"
        out.append(head + "\n" + _content(m.get("content"), f"messages[{i}].content"))
        if m.get("tool_calls"):
            out.append("\ntool_calls " + _canon(m["tool_calls"]))
        if m.get("tool_call_id"):
            out.append(f"\ntool_call_id {m['tool_call_id']}")
        out.append(_MSG_END)
    return "".join(out)


def _content(c: Any, where: str) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts: list[str] = []
        for j, p in enumerate(c):
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, Mapping):
                t = p.get("type")
                if t == "text" or (t is None and "text" in p):
                    text = p.get("text")
                    if not isinstance(text, str):
                        raise InvalidRequestBody(f"{where}[{j}].text", "must be a string")
                    parts.append(text)
                else:  # image_url, input_audio, …: identified by their (canonical) payload
                    parts.append(f"<{t}:{_canon(p)}>")
            else:
                raise InvalidRequestBody(f"{where}[{j}]", "must be a string or a content part object")
        return "".join(parts)
    raise InvalidRequestBody(where, f"must be a string, a list of parts or null, got {type(c).__name__}")


def _completion_prompt(p: Any, field: str) -> tuple[str, list[int] | None]:
    """Completion prompt → (text, token ids if the prompt was token ids)."""
    if isinstance(p, str):
        if not p:
            raise InvalidRequestBody(field, "is empty")
        return p, None
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):  # a batch: routed as one request, first prompt leads
            return _MSG_END.join(p), None
        if all(type(x) is int for x in p):
            return "", list(p)
        if all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in p):
            return "", [t for x in p for t in x]
    raise InvalidRequestBody(field, "must be a non-empty string, list of strings, or token ids")


def _int_field(body: Any, key: str) -> int:
    if not isinstance(body, Mapping):
        return 0
    v = body.get(key)
    return v if type(v) is int and v > 0 else 0


def _canon(x: Any) -> str:
    """A deterministic text form of a JSON value (key order must not change the prefix)."""
    try:
        return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(x)
