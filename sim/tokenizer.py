"""A deterministic, download-free tokenizer and chat template shared by the sim and the router.

Text is split into pieces — runs of letters (long runs cut into 4-letter chunks, roughly what BPE
does), runs of up to 3 digits, and single punctuation marks; whitespace only separates pieces —
and each piece maps to a stable id, `blake2b(piece) mod 128000`. Ids ≥ 128000 are the special
tokens of a Llama-3-like template. The same text always gives the same ids in every process.

Generated text is built from short words (`OUTPUT_WORDS`) each of which is exactly one piece, so
re-tokenizing an assistant reply in the next turn of a conversation yields exactly the ids the
engine generated: multi-turn conversations hit the prefix cache the previous reply, as
they do on a real server.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 128_256
NUM_REGULAR = 128_000  # ids below this are hashed pieces; the rest are special tokens
BOS = 128_000  # <|begin_of_text|>
START_HEADER = 128_006  # <|start_header_id|>
END_HEADER = 128_007  # <|end_header_id|>
EOT = 128_009  # <|eot_id|>
SPECIAL_TOKENS: dict[int, str] = {
    BOS: "<|begin_of_text|>",
    START_HEADER: "<|start_header_id|>",
    END_HEADER: "<|end_header_id|>",
    EOT: "<|eot_id|>",
}

_MAX_WORD = 6  # letter runs up to this length stay one piece
_CHUNK = 4  # longer runs are cut into pieces of this many letters
_PIECE = re.compile(r"[^\W\d_]+|\d{1,3}|[^\w\s]|_", re.UNICODE)

# Short common words: every one is a single piece, so generated text round-trips exactly.
OUTPUT_WORDS: tuple[str, ...] = tuple(
    """the of and to in is that it for as with was on be by at this are or from an which
    but not have has had were all can one their there been more when who will no if out so
    said what up its about into than them only other new some could time these two may then
    first any like now my such make over our even most after also did many before must
    back years where much your way well down should each just those people
    how too little state good very world still own see men work long get here both
    life being under never day same know while last might us great old year off
    come since go came right used take three small place put home large often
    hand high end found part water light sound word point form line call side set name
    play kind move try ask turn show keep near tree city earth eye head story saw left few
    open seem began run feel book took river car food sun four girl sea hard land horse
    stop fire south plan idea face wood main ship bird mile white road rock half order
    color cold step paper group music dog list farm wind king space""".split()
)
assert all(_PIECE.fullmatch(w) and len(w) <= _MAX_WORD for w in OUTPUT_WORDS)
assert len(set(OUTPUT_WORDS)) == len(OUTPUT_WORDS)


@functools.lru_cache(maxsize=1 << 17)  # words repeat: a 4k-token prompt has a few hundred distinct ones
def _piece_id(piece: str) -> int:
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % NUM_REGULAR


def _pieces(text: str) -> Iterable[str]:
    for match in _PIECE.finditer(text):
        piece = match.group()
        if len(piece) > _MAX_WORD and piece[0].isalpha():
            yield from (piece[i : i + _CHUNK] for i in range(0, len(piece), _CHUNK))
        else:
            yield piece


def encode(text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of `text` (plus a leading BOS if asked). Deterministic across processes."""
    ids = [BOS] if add_bos else []
    ids.extend(_piece_id(p) for p in _pieces(text))
    return ids


def _content_text(content: Any) -> str:
    """A chat message's content as text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, Mapping):
            if part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
        elif isinstance(part, str):
            parts.append(part)
    return " ".join(parts)


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids the engine sees for an OpenAI chat `messages` list.

    Llama-3 shaped: BOS, then for every message in order
    `<|start_header_id|> role <|end_header_id|> content <|eot_id|>`, then (by default) the
    assistant header that generation continues from. Content may be a string or a list of
    `{"type": "text", "text": ...}` parts (other part types are ignored).
    """
    ids = [BOS]
    for message in messages:
        ids.append(START_HEADER)
        ids.extend(encode(str(message.get("role", ""))))
        ids.append(END_HEADER)
        ids.extend(encode(_content_text(message.get("content"))))
        ids.append(EOT)
    if add_generation_prompt:
        ids.append(START_HEADER)
        ids.extend(encode("assistant"))
        ids.append(END_HEADER)
    return ids


# Public alias: the name other modules (e.g. the router's exact-prefix mode) should call.
encode_chat = apply_chat_template

_OUTPUT_IDS: tuple[int, ...] = tuple(_piece_id(w) for w in OUTPUT_WORDS)
_ID_TO_WORD: dict[int, str] = dict(zip(_OUTPUT_IDS, OUTPUT_WORDS))


class OutputStream:
    """The deterministic token sequence a request generates: a function of its prompt and a seed."""

    def __init__(self, prompt_ids: Sequence[int], seed: int = 0) -> None:
        h = hashlib.blake2b(digest_size=8)
        h.update(seed.to_bytes(8, "big", signed=True))
        for start in range(0, len(prompt_ids), 4096):
            h.update(",".join(map(str, prompt_ids[start : start + 4096])).encode())
        self._rng = random.Random(int.from_bytes(h.digest(), "big"))

    def next_token(self) -> int:
        return _OUTPUT_IDS[self._rng.randrange(len(_OUTPUT_IDS))]


def decode_token(token_id: int) -> str:
    """Text of one generated token, with its leading space (` word`)."""
    word = _ID_TO_WORD.get(token_id)
    if word is not None:
        return " " + word
    if token_id in SPECIAL_TOKENS:
        return SPECIAL_TOKENS[token_id]
    return f" <{token_id}>"


def decode(token_ids: Iterable[int]) -> str:
    """Text of generated tokens; `encode(decode(ids)) == ids` for every generated sequence."""
    return "".join(decode_token(t) for t in token_ids)
