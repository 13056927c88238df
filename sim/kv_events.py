"""SGLang's KV-cache events: block hashes, the three event types, and their msgpack wire forms.

Block hashes follow SGLang's radix cache (`mem_cache/utils.py`, 0.5.x): each full page gets
`digest = sha256(parent_digest ‖ token_0 ‖ … ‖ token_{n-1})` with every token id as 4 bytes
little-endian unsigned and no parent bytes for the first page; the published `block_hash` is the
first 8 bytes of that digest read as a signed big-endian int64. A router that tokenizes a prompt
with `sim.tokenizer` and calls `block_hashes(ids, page_size)` gets exactly the hashes a sim
publishes for those pages (and the hashes real SGLang publishes for the same token ids).

Wire forms of one published batch (frame 3 of `[topic, seq, payload]`):
  batch  = [ts, [event, ...], attn_dp_rank]                      (positional, every release)
  array  (≤ 0.5.18): ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium], ["BlockRemoved", block_hashes, medium],
                     ["AllBlocksCleared"]                         (one event per page)
  map    (≥ 0.5.20): {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
                      "token_ids": [...], "block_size": n, "lora_id": null, "medium": "GPU"},
                     {"type": "BlockRemoved", ...}, {"type": "AllBlocksCleared"}
                     (None-valued optional keys omitted; consecutive stores of one chain and
                     consecutive removals are merged into one event, as 0.5.23 does)
0.5.8 had no `medium`; 0.5.12 added it (`"GPU"`), which is what the array form here carries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Optional, Union

import msgspec

Encoding = Literal["array", "map"]
MEDIUM_GPU = "GPU"


# --------------------------------------------------------------------------- block hashes


def page_digest(parent_digest: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SGLang's chained page digest: sha256(parent digest ‖ each token as 4-byte LE uint)."""
    h = hashlib.sha256()
    if parent_digest:
        h.update(parent_digest)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def event_hash(digest: bytes) -> int:
    """The int64 `block_hash` SGLang publishes for a page digest (first 8 bytes, signed BE)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def lora_namespace(lora_id: str | None) -> bytes | None:
    """The digest a LoRA adapter's page chains start from (None: the base model's). SGLang keys its
    radix cache by `extra_key` (+= the adapter's lora_id), so an adapter's pages never match another
    namespace's, and its published hashes are namespaced (`namespaced_block_hash`): here its chains
    are seeded with a digest of the id. The first page's `parent_block_hash` stays null."""
    return None if lora_id is None else hashlib.sha256(b"lora\0" + lora_id.encode()).digest()


def page_digests(token_ids: Sequence[int], page_size: int, root: bytes | None = None) -> list[bytes]:
    """Chained digests of the full pages of `token_ids` (a trailing partial page has none); `root`:
    the namespace the chain starts in (`lora_namespace`)."""
    out: list[bytes] = []
    parent: bytes | None = root
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_digest(parent, token_ids[start : start + page_size])
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """The `block_hashes` a worker publishes for the full pages of `token_ids`, in order."""
    return [event_hash(d) for d in page_digests(token_ids, page_size)]


# --------------------------------------------------------------------------- events (in-process)


@dataclasses.dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU
    lora_name: Optional[str] = None  # the adapter whose namespace the blocks are in (map form, 0.5.23)


@dataclasses.dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: Optional[str] = MEDIUM_GPU


@dataclasses.dataclass
class AllBlocksCleared:
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def coalesce(events: Iterable[KvEvent]) -> list[KvEvent]:
    """Merge a store that continues the previous store's chain, and consecutive removals (0.5.23)."""
    out: list[KvEvent] = []
    for ev in events:
        tail = out[-1] if out else None
        if isinstance(tail, BlockRemoved) and isinstance(ev, BlockRemoved):
            if tail.medium == ev.medium:
                tail.block_hashes = tail.block_hashes + ev.block_hashes
                continue
        elif isinstance(tail, BlockStored) and isinstance(ev, BlockStored):
            if (
                tail.medium == ev.medium
                and tail.lora_id == ev.lora_id
                and tail.lora_name == ev.lora_name
                and tail.block_size == ev.block_size
                and tail.block_hashes
                and ev.parent_block_hash == tail.block_hashes[-1]
            ):
                tail.block_hashes = tail.block_hashes + ev.block_hashes
                tail.token_ids = tail.token_ids + ev.token_ids
                continue
        out.append(dataclasses.replace(ev) if not isinstance(ev, AllBlocksCleared) else ev)
    return out


# --------------------------------------------------------------------------- wire structs


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _MapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


_WIRE = {
    "array": (_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared),
    "map": (_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared),
}
_encoder = msgspec.msgpack.Encoder()


def _to_wire(ev: KvEvent, encoding: Encoding) -> Any:
    stored, removed, cleared = _WIRE[encoding]
    if isinstance(ev, BlockStored):
        return stored(
            block_hashes=ev.block_hashes,
            parent_block_hash=ev.parent_block_hash,
            token_ids=ev.token_ids,
            block_size=ev.block_size,
            lora_id=ev.lora_id,
            medium=ev.medium,
            **({"lora_name": ev.lora_name} if encoding == "map" else {}),
        )
    if isinstance(ev, BlockRemoved):
        return removed(block_hashes=ev.block_hashes, medium=ev.medium)
    return cleared()


def encode_batch(ts: float, events: Sequence[KvEvent], dp_rank: int, encoding: Encoding) -> bytes:
    """The msgpack payload of one published batch, as that SGLang generation encodes it."""
    if encoding not in _WIRE:
        raise ValueError(f"kv events encoding {encoding!r}: expected 'array' or 'map'")
    if encoding == "map":
        events = coalesce(events)
    wire = [_to_wire(ev, encoding) for ev in events]
    return _encoder.encode(_EventBatch(ts=ts, events=wire, attn_dp_rank=dp_rank))


def _event_from_obj(obj: Any) -> KvEvent | None:
    if isinstance(obj, dict):
        kind, get = obj.get("type"), obj.get
    elif isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], str):
        kind = obj[0]
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium"),
            "BlockRemoved": ("block_hashes", "medium"),
        }.get(kind, ())
        fields = dict(zip(names, obj[1:]))
        get = fields.get
    else:
        raise ValueError(f"kv event is neither a tagged map nor a tagged array: {obj!r:.60}")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=list(get("block_hashes") or []),
            parent_block_hash=get("parent_block_hash"),
            token_ids=list(get("token_ids") or []),
            block_size=int(get("block_size") or 0),
            lora_id=get("lora_id"),
            medium=get("medium"),
            lora_name=get("lora_name"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=list(get("block_hashes") or []), medium=get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this reader does not know: skip it


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent], int | None]:
    """Read a batch in either encoding → (ts, events, attn_dp_rank); unknown events/keys skipped.

    For tests and tools; raises ValueError on a payload that is not an SGLang event batch.
    """
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"kv event batch is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError(f"kv event batch is not [ts, events, rank]: {obj!r:.60}")
    events = [e for e in (_event_from_obj(o) for o in obj[1]) if e is not None]
    rank = obj[2] if len(obj) > 2 else None
    return float(obj[0]), events, rank
