"""Pinning a request to one attention-DP rank of an SGLang worker, exactly as SGLang accepts it.

What SGLang reads (checked in the released sources):
- 0.5.x (0.5.14, 0.5.23): `routed_dp_rank` in the body of /generate (`GenerateReqInput`),
  /v1/completions and /v1/chat/completions (`PDRoutingFields`), with `data_parallel_rank` still
  accepted as a deprecated alias (used only when `routed_dp_rank` is absent). The OpenAI routes also
  read the header `X-Data-Parallel-Rank`, and 0.5.23 the header `x-override-routed-dp-rank`; both
  override the body. A rank outside [0, dp_size) is refused with 400 (`routed_dp_rank=R out of range
  [0, N)`).
- 0.4.9: `data_parallel_rank` in the body of /generate only.
- sglang-router `--dp-aware` (`DPAwareWorker::prepare_request`) inserts `data_parallel_rank` into
  every JSON body it forwards (chat, completions, generate), overwriting any value there.

kvroute does the same as sglang-router — `data_parallel_rank` in the body, the one spelling every
release reads — and, because a client's own `routed_dp_rank` (body) or rank headers would win over
that alias on 0.5.x, sets `routed_dp_rank` to the same rank when the body has one and drops those
headers: the rank the router booked in its ledger is the rank that serves the request.
"""

from __future__ import annotations

import json
from typing import Any

RANK_FIELD = "data_parallel_rank"  # what sglang-router --dp-aware sends; every release reads it
ROUTED_FIELD = "routed_dp_rank"  # SGLang >= 0.5.14's own name; it wins over RANK_FIELD there
# request headers that override the body's rank on SGLang 0.5.x (dropped when kvroute pins a rank)
RANK_HEADERS = ("x-data-parallel-rank", "x-override-routed-dp-rank")
RANK_HEADER = "x-kvroute-rank"  # response header: the attention-DP rank that served it (a PD pair's decode rank)


def pinned_body(body: dict[str, Any], rank: int) -> bytes:
    """The JSON body to forward so that the worker serves it on `rank`."""
    out = dict(body)
    out[RANK_FIELD] = rank
    if out.get(ROUTED_FIELD) is not None:
        out[ROUTED_FIELD] = rank
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode()


def pinned_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` without the ones that would override the pinned rank."""
    return {k: v for k, v in headers.items() if k.lower() not in RANK_HEADERS}


# --- DP ranks inside a prefill/decode pair (docs/pd.md, "DP ranks in a PD pair") ---------------------

PREFILL_RANK_FIELD = "disagg_prefill_dp_rank"  # tells the decode server which prefill rank holds its KV
# request headers that override the body's ranks on SGLang 0.5.23 (`entrypoints/request_headers.py`)
PD_RANK_HEADERS = RANK_HEADERS + ("x-override-disagg-prefill-dp-rank",)


def pd_rank_fields(side: str, prefill_rank: int | None, decode_rank: int | None) -> dict[str, int]:
    """The rank fields one side of a PD pair gets, as sglang-router's PD mode with DP-aware workers
    sends them: the prefill request `routed_dp_rank` = its prefill rank; the decode request
    `routed_dp_rank` = its decode rank and `disagg_prefill_dp_rank` = the prefill rank (SGLang's
    decode side then skips asking the bootstrap server). A side without DP ranks gets none of its own."""
    out: dict[str, int] = {}
    if side == "prefill":
        if prefill_rank is not None:
            out[ROUTED_FIELD] = prefill_rank
        return out
    if decode_rank is not None:
        out[ROUTED_FIELD] = decode_rank
    if prefill_rank is not None:
        out[PREFILL_RANK_FIELD] = prefill_rank
    return out


def with_rank_fields(body: dict[str, Any], fields: dict[str, int]) -> dict[str, Any]:
    """`body` (a copy) with `fields` set; a client's deprecated `data_parallel_rank` is set to the
    same routed rank, so no spelling of the rank disagrees with the one the router booked."""
    if not fields:
        return body
    out = {**body, **fields}
    if ROUTED_FIELD in fields and out.get(RANK_FIELD) is not None:
        out[RANK_FIELD] = fields[ROUTED_FIELD]
    return out


def pd_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` without the ones that would override a PD pair's pinned ranks."""
    return {k: v for k, v in headers.items() if k.lower() not in PD_RANK_HEADERS}
