"""What the engine says it reused: `cached_tokens` of a response, read without parsing what it does not need.

SGLang reports the prompt tokens its radix cache served in every answer: chat and completion
responses in `usage.prompt_tokens_details.cached_tokens` (with `--enable-cache-report`, which the
sim always behaves as), `/generate` in `meta_info.cached_tokens`. A JSON answer is searched for
its `"usage":` (or `"meta_info":`) key from the end — inside a JSON string a quote is always
escaped, so the bytes `"usage":` can only be the key — and only that object is decoded. A stream
carries its usage in one final chunk (`stream_options.include_usage`; `/generate`: every event has
`meta_info`, the last one counts): the router asks the engine for it when the client did not
(`with_stream_usage`) and then removes that one event from what it relays (`UsageStrip`), so the
client gets exactly the stream it asked for; no other chunk is decoded, each piece is searched
once by one C-level regex (`"usage":{`, which every other chunk has as `"usage":null`).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

_USAGE_KEY = b'"usage":'
_META_KEY = b'"meta_info":'
_USAGE_OBJECT = re.compile(rb'"usage":\s*\{')
_DONE = b"data: [DONE]"
_DECODER = json.JSONDecoder()
_INJECTED = b'"stream_options":{"include_usage":true},'


class Usage(NamedTuple):
    prompt_tokens: int
    cached_tokens: int


def _object_at(data: bytes, key: bytes) -> Any:
    """The JSON value after the last `key` in `data` (None if absent or not decodable)."""
    i = data.rfind(key)
    if i < 0:
        return None
    try:
        text = data[i + len(key):].decode("utf-8", "replace").lstrip()
        return _DECODER.raw_decode(text)[0]
    except ValueError:
        return None


def _from_usage(u: Any) -> Usage | None:
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = u.get("prompt_tokens")
    if type(cached) is not int or type(prompt) is not int or cached < 0 or prompt < 0:
        return None  # (no --enable-cache-report: nothing to compare)
    return Usage(prompt, cached)


def _from_meta(m: Any) -> Usage | None:
    if not isinstance(m, dict):
        return None
    cached, prompt = m.get("cached_tokens"), m.get("prompt_tokens")
    if type(cached) is not int or type(prompt) is not int or cached < 0 or prompt < 0:
        return None
    return Usage(prompt, cached)


def body_usage(data: bytes, path: str) -> Usage | None:
    """The usage of a whole JSON answer to `path` (None: it has none, e.g. an error)."""
    if path == "/generate":
        return _from_meta(_object_at(data, _META_KEY))
    return _from_usage(_object_at(data, _USAGE_KEY))


def stream_usage(tail: bytes, path: str) -> Usage | None:
    """The usage in the last events of a stream (`tail`: its last piece or two)."""
    end = tail.rfind(_DONE)
    data = tail[:end] if end >= 0 else tail
    if path == "/generate":
        return _from_meta(_object_at(data, _META_KEY))
    m = None
    for m in _USAGE_OBJECT.finditer(data):
        pass
    if m is None:
        return None
    try:
        return _from_usage(_DECODER.raw_decode(data[m.end() - 1:].decode("utf-8", "replace"))[0])
    except ValueError:
        return None


def wants_stream_usage(body: dict[str, Any]) -> bool:
    """Whether a streamed chat/completion request asked for the final usage chunk itself."""
    so = body.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


def with_stream_usage(raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The request as sent upstream with `stream_options.include_usage` on: the raw bytes with the
    option spliced in after the opening brace (no re-serialisation) when the client sent no
    `stream_options`, else the body re-encoded with it merged. Returns (raw, body)."""
    so = body.get("stream_options")
    merged = {**body, "stream_options": {**(so if isinstance(so, dict) else {}), "include_usage": True}}
    if "stream_options" not in body and body:
        s = raw.lstrip()
        if s[:1] == b"{":
            return _INJECTED.join((b"{", s[1:])), merged
    return json.dumps(merged, separators=(",", ":")).encode(), merged


class UsageStrip:
    """Removes the usage event the router asked for from a relayed chat/completion stream and keeps
    its usage. Feed every piece to `piece`, relay what it returns. A piece that ends inside an event
    keeps that event's start back until its end arrives (a client cannot use half an event either;
    a piece normally ends on an event's end, and then nothing is held)."""

    __slots__ = ("usage", "_held")

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self._held = b""  # the start of an event whose end has not arrived yet

    def piece(self, data: bytes) -> bytes:
        if self._held:
            data = self._held + data
            self._held = b""
        if not data.endswith(b"\n\n"):
            i = data.rfind(b"\n\n")
            cut = 0 if i < 0 else i + 2
            data, self._held = data[:cut], data[cut:]
        m = _USAGE_OBJECT.search(data)
        if m is None:
            return data
        # event boundaries: every event ends with a blank line, which no JSON payload contains
        start = data.rfind(b"\n\n", 0, m.start())
        start = 0 if start < 0 else start + 2
        end = data.find(b"\n\n", m.end()) + 2
        self.usage = stream_usage(data[start:end], "")
        return data[:start] + data[end:]

    def flush(self) -> bytes:
        """What is still held at the stream's end (an unterminated event: relayed as it came)."""
        held, self._held = self._held, b""
        return held
