"""The whole NSA pipeline on CUDA against the float64 CPU reference (outputs and every gradient).

Selection is compared separately (test_cuda_selection.py); here the reference's own block indices are passed
to both sides for the error bound, so that a near-tie of selection scores cannot move a block, and the
pipeline's internal selection is checked to equal select_blocks on the same device bit for bit.
Bound as in attention_check.py: kernel error <= 2 x the error of the naive torch NSA in the input precision.
"""
import pytest
import torch

import naive_nsa
import sparseattn
from attention_check import assert_bounded, poison_allocator
from helpers import cu_seqlens_of, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

CASES = [  # (T, Hq, Hkv, Dqk, Dv, config)
    (1000, 8, 2, 128, 128, sparseattn.NSAConfig()),
    (333, 6, 2, 64, 64, sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64)),
    (700, 4, 1, 192, 128, sparseattn.NSAConfig(cmp_block=64, cmp_stride=64, sel_block=128, num_selected=8,
                                               window=100)),
    (65, 3, 3, 256, 256, sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, num_selected=3, window=5)),
]


def reference_indices(q, k, v, config, cu_seqlens=None):
    """The float64 CPU reference's own selection for these inputs."""
    c = config
    cu_cmp = None if cu_seqlens is None else sparseattn.compressed_cu_seqlens(cu_seqlens, c.cmp_block, c.cmp_stride)
    k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=c.cmp_block, stride=c.cmp_stride, cu_seqlens=cu_seqlens)
    _, lse = sparseattn.compressed_attention(q, k_cmp, v_cmp, block=c.cmp_block, stride=c.cmp_stride,
                                             cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp)
    return sparseattn.select_blocks(q, k_cmp, lse, cmp_block=c.cmp_block, cmp_stride=c.cmp_stride,
                                    sel_block=c.sel_block, num_selected=c.num_selected, num_init=c.num_init,
                                    num_local=c.num_local, cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp)


def run(fn, inputs, d_o):
    o = fn(*inputs)
    return [o, *torch.autograd.grad(o, inputs, d_o)]


def check_against_reference(lowp_inputs, config, dtype, cu_seqlens=None):
    names = ["o", "dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"]
    inputs64 = [x.detach().double().cpu().requires_grad_() for x in lowp_inputs]
    cu_cpu = None if cu_seqlens is None else cu_seqlens.cpu()
    idx = reference_indices(*(x.detach() for x in inputs64[:3]), config, cu_cpu)
    d_o = torch.randn(*lowp_inputs[0].shape[:-1], lowp_inputs[2].shape[-1], device="cuda", dtype=dtype)

    def ours(*x):
        return sparseattn.nsa_attention(*x, config=config, block_indices=idx.cuda(), cu_seqlens=cu_seqlens)

    def naive(*x):
        return naive_nsa.nsa_attention(*x, config=config, block_indices=idx.to(x[0].device), cu_seqlens=
                                       None if cu_seqlens is None else cu_seqlens.to(x[0].device))

    ref64 = [t.detach() for t in run(lambda *x: sparseattn.nsa_attention(*x, config=config, block_indices=idx,
                                                                         cu_seqlens=cu_cpu), inputs64, d_o.double().cpu())]
    ref_lowp = [t.detach().cpu() for t in run(naive, lowp_inputs, d_o)]
    poison_allocator()
    got = [t.detach().cpu() for t in run(ours, lowp_inputs, d_o)]
    rows = None if cu_seqlens is None else int(cu_cpu[-1])
    for name, g, r64, rl in zip(names, got, ref64, ref_lowp):
        if rows is not None:  # packed: rows past the last sequence are not part of any sequence
            g, r64, rl = g[:rows], r64[:rows], rl[:rows]
        assert_bounded(name, g, r64, rl, dtype)


def leaves(*xs):
    return [x.detach().requires_grad_() for x in xs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-{c[1]}x{c[2]}-{c[3]}_{c[4]}" if isinstance(c, tuple) else None)
def test_nsa_batched_matches_reference(dtype, case):
    T, Hq, Hkv, Dqk, Dv, config = case
    q = torch.randn(2, T, Hq, Dqk, device="cuda", dtype=dtype)
    k = torch.randn(2, T, Hkv, Dqk, device="cuda", dtype=dtype)
    v = torch.randn(2, T, Hkv, Dv, device="cuda", dtype=dtype)
    g = torch.rand(3, 2, T, Hq, device="cuda", dtype=dtype)
    check_against_reference(leaves(q, k, v, *g), config, dtype)


@pytest.mark.parametrize("shape", [(1100, 8, 2), (300, 16, 1)], ids=lambda s: f"T{s[0]}-{s[1]}x{s[2]}")
def test_nsa_gates_folded_into_branches(attention_mma, shape):
    """On CUDA each branch's gate is folded into its backward (P scaled per row, no scaled copy of d_o): gates of
    both signs, both MMA paths, the KV-block-outer dQ (G = 4, T >= 1024) and the query-outer one (G = 16)."""
    T, Hq, Hkv = shape
    dtype = torch.bfloat16
    q = torch.randn(1, T, Hq, 128, device="cuda", dtype=dtype)
    k = torch.randn(1, T, Hkv, 128, device="cuda", dtype=dtype)
    v = torch.randn(1, T, Hkv, 128, device="cuda", dtype=dtype)
    g = torch.rand(3, 1, T, Hq, device="cuda", dtype=dtype) * 2 - 1
    check_against_reference(leaves(q, k, v, *g), sparseattn.NSAConfig(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_nsa_packed_matches_reference(dtype):
    lengths = [1, 100, 333, 64]
    cu = cu_seqlens_of(lengths, device="cuda")
    N, Hq, Hkv, D = sum(lengths), 4, 2, 128
    config = sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=50)
    x = [torch.randn(N + 3, H, D, device="cuda", dtype=dtype) for H in (Hq, Hkv, Hkv)]
    g = torch.rand(3, N + 3, Hq, device="cuda", dtype=dtype)
    check_against_reference(leaves(*x, *g), config, dtype, cu_seqlens=cu)


def test_internal_selection_is_select_blocks():
    T, Hq, Hkv, D = 2048, 16, 2, 128
    c = sparseattn.NSAConfig()
    q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for H in (Hq, Hkv, Hkv))
    g = torch.rand(3, 1, T, Hq, device="cuda", dtype=torch.bfloat16)
    k_cmp, v_cmp = sparseattn.compress_kv(k, v)
    _, lse = sparseattn.compressed_attention(q, k_cmp, v_cmp)
    idx = sparseattn.select_blocks(q, k_cmp, lse)
    inside = sparseattn.nsa_attention(q, k, v, *g, config=c)
    outside = sparseattn.nsa_attention(q, k, v, *g, config=c, block_indices=idx)
    assert torch.equal(inside, outside)


def test_nsa_backward_is_deterministic():
    T, Hq, Hkv, D = 1500, 8, 2, 64
    x = leaves(*(torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for H in (Hq, Hkv, Hkv)),
               *torch.rand(3, 1, T, Hq, device="cuda", dtype=torch.bfloat16))
    d_o = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    first = run(lambda *a: sparseattn.nsa_attention(*a), x, d_o)
    second = run(lambda *a: sparseattn.nsa_attention(*a), x, d_o)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_nsa_float32_on_cuda_is_a_clear_error():
    q = torch.randn(1, 64, 2, 64, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="bfloat16 or float16"):
        sparseattn.nsa_attention(q, q, q, g_swa=torch.rand(1, 64, 2, device="cuda"))


def test_forward_scratch_is_separate_from_the_kept_workspace():
    """Where the window's output slice cannot hold the selection steps' working memory (the KV-block-outer
    partials at G <= 9), it lives in a forward scratch that is freed on return, not in the kept workspace;
    a call without it is a clear error."""
    from sparseattn import _C, _ops
    T, Hq, Hkv, D = 2048, 8, 2, 64
    c = sparseattn.NSAConfig()
    config = (c.cmp_block, c.cmp_stride, c.sel_block, c.num_selected, c.num_init, c.num_local, c.window, c.scale)
    q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for H in (Hq, Hkv, Hkv))
    g = torch.rand(3, 1, T, Hq, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    sizes = {query: _ops._nsa_size(getattr(_C, query), "nsa_attention", q, k, v, None, None, None, *g, o, None, None,
                                   T, config)
             for query in ("nsa_workspace_size", "nsa_forward_scratch_size")}
    branch_output = T * Hq * D * 2  # the window's output slice, one of three such slices of the workspace
    assert sizes["nsa_forward_scratch_size"] > branch_output
    assert sizes["nsa_workspace_size"] < 4 * branch_output  # the rest: lse, indices and compressed K/V
    workspace = torch.empty(sizes["nsa_workspace_size"], dtype=torch.uint8, device="cuda")
    with pytest.raises(sparseattn.SparseAttnError, match="scratch.*nsa_forward_scratch_size"):
        _C.nsa_attention(q, k, v, None, None, None, *g, o, None, None, T, *config, workspace, None,
                         torch.cuda.current_stream().cuda_stream)
