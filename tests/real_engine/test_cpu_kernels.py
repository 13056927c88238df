"""The plain-torch stand-in for SGLang's two CPU `sgl_kernel` ops (cpu_kernels/sgl_kernel), held to
the contracts of the kernels it replaces: sgl-kernel's C++ ops `assign_req_to_token_pool_cpu` and
`copy_all_layer_kv_cache_cpu` (csrc/cpu), which are the CPU counterparts of the Triton kernels
`assign_req_to_token_pool` (sglang/srt/mem_cache/allocation.py) and `copy_all_layer_kv_cache_tiled`
(sglang/kernels/ops/kvcache/cache_move.py). Each case would fail on a wrong implementation: wrong
offsets, a row/column mix-up, a sequential (not gather-then-scatter) copy, ignored dtype checks."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the real-engine lane runs in scripts/sglang_env.sh 0.5.23's venv")

from tests.real_engine.engines import CPU_KERNELS, REPO  # noqa: E402

_spec = importlib.util.spec_from_file_location("kvroute_sgl_kernel_stand_in", CPU_KERNELS / "sgl_kernel" / "__init__.py")
K = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(K)


def _assign_reference(rpi, req_to_token, start, end, out_cache_loc):
    """The C++ op's documented effect, element by element."""
    out = req_to_token.clone()
    pt = 0
    for i in range(rpi.numel()):
        for j in range(int(start[i]), int(end[i])):
            out[int(rpi[i]), j] = int(out_cache_loc[pt])
            pt += 1
    return out


@pytest.mark.parametrize("rpi_dtype,off_dtype", [(torch.int32, torch.int32), (torch.int64, torch.int32),
                                                 (torch.int64, torch.int64), (torch.int32, torch.int64)])
def test_assign_req_to_token_pool_writes_each_requests_slots_after_the_previous_ones(rpi_dtype, off_dtype):
    g = torch.Generator().manual_seed(7)
    num_reqs, pool_len = 6, 48
    req_to_token = torch.randint(-5, 5, (num_reqs, pool_len), dtype=torch.int32, generator=g)
    before = req_to_token.clone()
    rpi = torch.tensor([4, 0, 2, 5], dtype=rpi_dtype)
    start = torch.tensor([0, 16, 5, 47], dtype=off_dtype)
    end = torch.tensor([16, 16, 37, 48], dtype=off_dtype)  # a full page, an empty one, an odd span, the last slot
    total = int((end - start).sum())
    out_cache_loc = torch.randperm(100_000, generator=g)[:total].to(torch.int64)
    expected = _assign_reference(rpi, before, start, end, out_cache_loc)
    assert K.assign_req_to_token_pool_cpu(rpi, req_to_token, start, end, out_cache_loc, pool_len) is None  # in place
    assert torch.equal(req_to_token, expected)
    assert req_to_token.dtype == torch.int32
    untouched = torch.ones_like(before, dtype=torch.bool)
    for i in range(rpi.numel()):
        untouched[int(rpi[i]), int(start[i]):int(end[i])] = False
    assert torch.equal(req_to_token[untouched], before[untouched])  # nothing else moved


def test_assign_req_to_token_pool_as_sglang_calls_it():
    """allocation.assign_req_to_token_pool_func's CPU branch: int64 pool indices, int64 lens, one
    decode token per request (start = seq_len - 1)."""
    req_to_token = torch.zeros((8, 32), dtype=torch.int32)
    rpi = torch.tensor([3, 1], dtype=torch.int64)
    start = torch.tensor([9, 0], dtype=torch.int64)
    end = start + 1
    loc = torch.tensor([1234, 77], dtype=torch.int64)
    K.assign_req_to_token_pool_cpu(rpi, req_to_token, start, end, loc, req_to_token.shape[1])
    assert int(req_to_token[3, 9]) == 1234 and int(req_to_token[1, 0]) == 77
    assert int(req_to_token.count_nonzero()) == 2


@pytest.mark.parametrize("bad", ["rtt_dtype", "loc_dtype", "offset_dtypes", "pool_len", "dims", "too_few_slots"])
def test_assign_req_to_token_pool_refuses_what_the_cpp_op_refuses(bad):
    rtt = torch.zeros((4, 16), dtype=torch.int32)
    rpi = torch.tensor([1], dtype=torch.int64)
    start, end = torch.tensor([0], dtype=torch.int64), torch.tensor([4], dtype=torch.int64)
    loc = torch.arange(4, dtype=torch.int64)
    pool_len = 16
    if bad == "rtt_dtype":
        rtt = rtt.to(torch.int64)
    elif bad == "loc_dtype":
        loc = loc.to(torch.int32)
    elif bad == "offset_dtypes":
        end = end.to(torch.int32)
    elif bad == "pool_len":
        pool_len = 15
    elif bad == "dims":
        rtt = rtt.view(-1)
    elif bad == "too_few_slots":
        loc = loc[:3]
    with pytest.raises(RuntimeError):
        K.assign_req_to_token_pool_cpu(rpi, rtt, start, end, loc, pool_len)


def _kv_pool(layers=2, slots=40, heads=2, dim=8, dtype=torch.float32, seed=3):
    """K and V buffers laid out as SGLang's MHATokenToKVPool allocates them on CPU, with its
    data_ptrs / data_strides (`_init_data_ptrs_and_strides`)."""
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.randn((slots, heads, dim), generator=g).to(dtype) for _ in range(2 * layers)]
    data_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs])
    return bufs, data_ptrs, strides


@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_copies_rows_in_every_buffer(loc_dtype, dtype):
    bufs, ptrs, strides = _kv_pool(dtype=dtype)
    before = [b.clone() for b in bufs]
    src = torch.tensor([1, 5, 39], dtype=loc_dtype)
    tgt = torch.tensor([20, 0, 7], dtype=loc_dtype)
    K.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before):
        exp = old.clone()
        exp[tgt.long()] = old[src.long()]
        assert torch.equal(b, exp)


def test_copy_all_layer_kv_cache_is_a_gather_then_scatter_when_locations_overlap():
    """The kernel reads every source row before writing any target row: a rotation 1→2→3→1
    moves each row once (a row-by-row copy would smear row 1 over all three)."""
    bufs, ptrs, strides = _kv_pool()
    before = [b.clone() for b in bufs]
    src = torch.tensor([1, 2, 3])
    tgt = torch.tensor([2, 3, 1])
    K.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before):
        assert torch.equal(b[2], old[1]) and torch.equal(b[3], old[2]) and torch.equal(b[1], old[3])
        assert torch.equal(b[4:], old[4:]) and torch.equal(b[0], old[0])


def test_copy_all_layer_kv_cache_buffers_of_different_row_sizes_and_sglang_warm_up_call():
    g = torch.Generator().manual_seed(1)
    k = torch.randn((16, 4, 8), generator=g)  # 128 B rows
    scale = torch.randn((16, 3), generator=g)  # 12 B rows (e.g. a scale buffer in the same list)
    bufs = [k, scale]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs])
    before = [b.clone() for b in bufs]
    zero = torch.zeros(256, dtype=torch.int64)  # cache_move's warm-up: copy slot 0 onto itself, num_locs 1
    K.copy_all_layer_kv_cache_cpu(ptrs, strides, zero[:1], zero[:1])
    assert all(torch.equal(b, o) for b, o in zip(bufs, before))
    K.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([15]), torch.tensor([0]))
    assert torch.equal(k[15], before[0][0]) and torch.equal(scale[15], before[1][0])
    assert torch.equal(k[:15], before[0][:15]) and torch.equal(scale[:15], before[1][:15])
    K.copy_all_layer_kv_cache_cpu(ptrs[:0], strides[:0], torch.tensor([1]), torch.tensor([0]))  # no buffers: no-op


@pytest.mark.parametrize("bad", ["ptr_dtype", "stride_dtype", "mixed_locs", "count"])
def test_copy_all_layer_kv_cache_refuses_what_the_cpp_op_refuses(bad):
    bufs, ptrs, strides = _kv_pool()
    src, tgt = torch.tensor([1]), torch.tensor([2])
    if bad == "ptr_dtype":
        ptrs = ptrs.view(torch.int64)
    elif bad == "stride_dtype":
        strides = strides.to(torch.int32)
    elif bad == "mixed_locs":
        tgt = tgt.to(torch.int32)
    elif bad == "count":
        tgt = torch.tensor([2, 3])
    with pytest.raises(RuntimeError):
        K.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)


def test_speculative_names_import_but_refuse_to_run():
    for name in K._SPECULATIVE_ONLY:
        with pytest.raises(NotImplementedError, match="speculative"):
            getattr(K, name)()


def test_sglang_cpu_engine_imports_the_stand_in():
    """With SGLANG_USE_CPU_ENGINE=1 and the stand-in on PYTHONPATH, SGLang's two callers bind to
    these very functions (the lane's engines then run them on every prefill/decode step)."""
    pytest.importorskip("sglang")
    code = ("import sglang.srt.mem_cache.allocation as a, sglang.kernels.ops.kvcache.cache_move as c, sgl_kernel;"
            "assert a._is_cpu and c._is_cpu;"
            "assert a.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu;"
            "assert c.copy_all_layer_kv_cache_cpu is sgl_kernel.copy_all_layer_kv_cache_cpu;"
            "print(sgl_kernel.__file__)")
    from tests.real_engine.engines import engine_env

    out = subprocess.run([sys.executable, "-c", code], env=engine_env("ipc:///nonexistent"), cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert str(CPU_KERNELS) in out.stdout
