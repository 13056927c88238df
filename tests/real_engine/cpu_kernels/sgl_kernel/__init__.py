"""TEST-ONLY stand-in for the two `sgl_kernel` functions SGLang 0.5.23's CPU engine imports
unconditionally — written in plain torch for kvroute's real-engine lane (tests/real_engine), never a
replacement for the real `sglang-kernel` package.

With `SGLANG_USE_CPU_ENGINE=1`, SGLang 0.5.23 runs `from sgl_kernel import …` at import time in two
modules, whatever the CPU:

- `sglang/srt/mem_cache/allocation.py`: `assign_req_to_token_pool_cpu` (every prefill and decode
  step writes its new KV slots into the request-to-token map through it);
- `sglang/kernels/ops/kvcache/cache_move.py`: `copy_all_layer_kv_cache_cpu` (moving KV rows inside
  the pool).

Seven more names are imported at import time on the CPU path but only called by speculative
decoding (EAGLE / tree verification: `sglang/kernels/ops/speculative/{spec_tree,eagle,
multi_layer_eagle,cache_locs}.py`), which the lane never enables: they are placeholders here that
raise if called (`_SPECULATIVE_ONLY`). Every other sgl_kernel op on the CPU path is behind
`cpu_has_amx_support()` (AMX tiles, which this machine has not), so SGLang takes its torch-native
paths. The real package is a CUDA/C++ build
(`sglang-kernel`, several hundred MB, CPU ops only in its x86 AMX build); this directory is put on
the engine process's PYTHONPATH by the lane (tests/real_engine/engines.py), not installed.

Each function keeps the contract of the kernel it replaces (sgl-kernel's `csrc/cpu` C++ op and the
Triton kernel beside its caller), checked by tests/real_engine/test_cpu_kernels.py.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+kvroute.cpu-stand-in"

_INDEX_TYPES = (torch.int32, torch.int64)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"sgl_kernel stand-in: {msg}")


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Scatter freshly allocated KV slots into the request-to-token map, in place:

        req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[p_i:p_i + n_i]

    where n_i = end_offset[i] - start_offset[i] and p_i = n_0 + … + n_{i-1} (the slots of request i
    follow those of the requests before it in `out_cache_loc`). Dtypes as the C++ op checks them:
    `req_to_token` int32 [max_reqs, pool_len], `out_cache_loc` int64, indices and offsets int32 or
    int64 (start and end alike)."""
    _check(req_to_token.dim() == 2, "req_to_token must be 2-D")
    _check(req_to_token.dtype == torch.int32, "req_to_token must be int32")
    _check(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _check(start_offset.dtype == end_offset.dtype, "start_offset and end_offset must share a dtype")
    _check(req_pool_indices.dtype in _INDEX_TYPES and start_offset.dtype in _INDEX_TYPES, "index tensors must be int32/int64")
    _check(req_to_token.size(1) == pool_len, "pool_len must equal req_to_token.size(1)")
    bs = req_pool_indices.size(0)
    _check(start_offset.numel() == bs and end_offset.numel() == bs, "one start and end offset per request")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    total = sum(e - s for s, e in zip(starts, ends))
    _check(total <= out_cache_loc.numel(), "out_cache_loc holds fewer slots than the offsets need")
    pt = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pt:pt + n].to(torch.int32)
        pt += n


def _rows(ptr: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """A uint8 [num_rows, row_bytes] view of the memory at `ptr` (no copy)."""
    buf = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every K/V buffer b (base address `data_ptrs[b]`, `strides[b]` bytes per slot row), copy
    the slot rows `src_loc` to `tgt_loc`: buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]. Like the
    Triton kernel, safe when the two sets overlap: all source rows of a buffer are read before any
    target row of it is written (gather, then scatter). `data_ptrs` uint64, `strides` int64, the
    locations int32 or int64 (both alike)."""
    _check(data_ptrs.dtype == torch.uint64, "data_ptrs must be uint64")
    _check(strides.dtype == torch.int64, "strides must be int64")
    _check(tgt_loc.dtype == src_loc.dtype and tgt_loc.dtype in _INDEX_TYPES, "locations must share an int32/int64 dtype")
    _check(strides.numel() == data_ptrs.numel(), "one stride per buffer")
    _check(src_loc.numel() == tgt_loc.numel(), "as many source as target locations")
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    _check(int(src.min()) >= 0 and int(tgt.min()) >= 0, "negative slot index")
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    # uint64 → Python int through int64's bits (addresses above 2**63 come out negative)
    for ptr, row_bytes in zip(data_ptrs.view(torch.int64).tolist(), strides.tolist()):
        rows = _rows(ptr % (1 << 64), int(row_bytes), num_rows)
        staged = rows.index_select(0, src)  # a copy: the gather completes before the scatter
        rows.index_copy_(0, tgt, staged)


# Imported at import time on the CPU path, called only by speculative decoding (never enabled here).
_SPECULATIVE_ONLY = (
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",  # speculative/spec_tree.py
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",  # speculative/eagle.py
    "rotate_input_ids_cpu",  # speculative/multi_layer_eagle.py
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",  # speculative/cache_locs.py
)


def _not_implemented(name: str):
    def placeholder(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: kvroute's test-only CPU stand-in has no speculative-decoding kernels "
            "(tests/real_engine/cpu_kernels); install the real sglang-kernel for speculative decoding")

    placeholder.__name__ = placeholder.__qualname__ = name
    return placeholder


for _name in _SPECULATIVE_ONLY:
    globals()[_name] = _not_implemented(_name)
del _name
