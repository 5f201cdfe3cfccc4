"""nsa_attention(recompute=True): the same output and gradients as the default, bit for bit, and nothing kept for
the backward beyond the inputs (checked by the tensors autograd saves)."""
import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()

CFG = sa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, num_local=1, window=16)


def inputs(gen, packed=False):
    T = 97
    shape = (T,) if packed else (2, T)
    q = torch.randn(*shape, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*shape, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shape, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    gates = [torch.rand(*shape, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    return q, k, v, gates


def saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(total)


@pytest.mark.parametrize("packed", [False, True])
def test_recompute_gives_the_same_gradients_and_keeps_less(packed):
    gen = torch.Generator().manual_seed(int(packed))
    q, k, v, gates = inputs(gen, packed)
    cu = torch.tensor([0, 40, 97], dtype=torch.int32) if packed else None
    d_o = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    results = {}
    for recompute in (False, True):
        def run():
            return sa.nsa_attention(q, k, v, *gates, config=CFG, cu_seqlens=cu, recompute=recompute)
        o, kept = saved_bytes(run)
        grads = torch.autograd.grad(o, (q, k, v, *gates), d_o)
        results[recompute] = (o, grads, kept)
    o0, g0, kept0 = results[False]
    o1, g1, kept1 = results[True]
    assert torch.equal(o0, o1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, *gates))
    index_bytes = 0 if cu is None else 2 * cu.numel() * cu.element_size()  # cu_seqlens and the compressed one
    assert kept1 <= inputs_bytes + index_bytes < kept0  # the workspace (three branch outputs) dominates the default


def test_module_switch_and_no_grad():
    core = sa.NativeSparseAttentionCore(CFG, recompute=True)
    assert "recompute=True" in repr(core)
    gen = torch.Generator().manual_seed(3)
    q, k, v, gates = inputs(gen)
    with torch.no_grad():
        assert torch.equal(core(q, k, v, *gates), sa.nsa_attention(q, k, v, *gates, config=CFG))
    with pytest.raises(sa.SparseAttnTypeError, match="recompute"):
        sa.NativeSparseAttentionCore(CFG, recompute="yes")


@pytest.mark.skipif(not torch.cuda.is_available() or not sa.built_with_cuda(), reason="needs a CUDA GPU and build")
def test_recompute_on_cuda_is_bit_equal_and_lowers_the_peak():
    gen = torch.Generator(device="cuda").manual_seed(4)
    T, opts = 8192, dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, T, 16, 128, generator=gen, **opts).requires_grad_()
    k = torch.randn(1, T, 1, 128, generator=gen, **opts).requires_grad_()
    v = torch.randn(1, T, 1, 128, generator=gen, **opts).requires_grad_()
    gates = [torch.rand(1, T, 16, generator=gen, **opts).requires_grad_() for _ in range(3)]
    d_o = torch.randn(q.shape, generator=gen, **opts)
    results = {}
    for recompute in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        o = sa.nsa_attention(q, k, v, *gates, recompute=recompute)
        grads = torch.autograd.grad(o, (q, k, v, *gates), d_o)
        torch.cuda.synchronize()
        results[recompute] = (o, grads, torch.cuda.max_memory_allocated() - base)
    assert torch.equal(results[False][0], results[True][0])
    for a, b in zip(results[False][1], results[True][1]):
        assert torch.equal(a, b)
    assert results[True][2] < results[False][2]
