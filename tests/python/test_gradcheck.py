"""torch.autograd.gradcheck of every differentiable op on small float64 inputs (CPU reference)."""

import pytest
import torch
from torch.autograd import gradcheck

from helpers import cu_seqlens_of, gates, random_indices, randn, require_sparseattn

sa = require_sparseattn()

CMP, STRIDE, SEL = 8, 4, 16
CFG = dict(cmp_block=CMP, cmp_stride=STRIDE, sel_block=SEL, num_selected=2, num_init=1, num_local=1, window=8)


def leaf(*shape):
    return randn(*shape, requires_grad=True)


def check(fn, inputs):
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, nondet_tol=0.0)


def test_compress_kv_batched():
    k, v = leaf(1, 37, 2, 3), leaf(1, 37, 2, 2)
    check(lambda k, v: sa.compress_kv(k, v, block=CMP, stride=STRIDE), (k, v))


def test_compress_kv_packed():
    lengths = [9, 0, 20, 3]
    n = sum(lengths)
    cu = cu_seqlens_of(lengths)
    k, v = leaf(n, 2, 3), leaf(n, 2, 2)
    rows = int(sa.compressed_cu_seqlens(cu, block=CMP, stride=STRIDE)[-1])

    def fn(k, v):
        kc, vc = sa.compress_kv(k, v, block=CMP, stride=STRIDE, cu_seqlens=cu)
        return kc[:rows], vc[:rows]  # rows past the last sequence are unspecified

    check(fn, (k, v))


@pytest.mark.parametrize("G", [1, 2, 3])
def test_compressed_attention_batched(G):
    T = 30
    tc = (T - CMP) // STRIDE + 1
    q, kc, vc = leaf(2, T, 2 * G, 3), leaf(2, tc, 2, 3), leaf(2, tc, 2, 2)
    check(lambda q, kc, vc: sa.compressed_attention(q, kc, vc, block=CMP, stride=STRIDE)[0], (q, kc, vc))


def test_compressed_attention_packed_and_scale():
    lengths = [12, 3, 21]
    cu = cu_seqlens_of(lengths)
    ccu = sa.compressed_cu_seqlens(cu, block=CMP, stride=STRIDE)
    n = sum(lengths)
    q, kc, vc = leaf(n, 2, 3), leaf(n // STRIDE, 1, 3), leaf(n // STRIDE, 1, 4)
    rows = int(ccu[-1])

    def fn(q, kc, vc):
        o, _ = sa.compressed_attention(q, kc, vc, block=CMP, stride=STRIDE, scale=0.7, cu_seqlens=cu,
                                       cu_seqlens_cmp=ccu)
        return o

    # rows of kc/vc past the last compressed sequence are unused: their gradient must be 0 (gradcheck checks)
    check(fn, (q, kc, vc))
    del rows


@pytest.mark.parametrize("G", [1, 2])
def test_selected_attention_batched(G, generator):
    T = 40
    q, k, v = leaf(1, T, 2 * G, 3), leaf(1, T, 2, 3), leaf(1, T, 2, 2)
    idx = random_indices(T, 2, 2, SEL, generator, batch=1)
    check(lambda q, k, v: sa.selected_attention(q, k, v, idx, block=SEL)[0], (q, k, v))


def test_selected_attention_packed(generator):
    lengths = [17, 1, 22]
    cu = cu_seqlens_of(lengths)
    n = sum(lengths)
    q, k, v = leaf(n, 2, 3), leaf(n, 1, 3), leaf(n, 1, 3)
    idx = torch.cat([random_indices(t, 1, 2, SEL, generator) for t in lengths])
    check(lambda q, k, v: sa.selected_attention(q, k, v, idx, block=SEL, scale=0.9, cu_seqlens=cu)[0],
          (q, k, v))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0)),
                                           (False, (2, 1))])
def test_flash_attention(causal, window):
    q, k, v = leaf(1, 7, 4, 3), leaf(1, 9, 2, 3), leaf(1, 9, 2, 2)
    check(lambda q, k, v: sa.flash_attention(q, k, v, causal=causal, window=window), (q, k, v))


@pytest.mark.parametrize("bias_shape", [(1, 2, 1, 9), (2, 4, 6, 9), (1, 1, 6, 9)])
def test_flash_attention_bias_and_mask(bias_shape):
    q, k, v = leaf(2, 6, 4, 3), leaf(2, 9, 2, 3), leaf(2, 9, 2, 2)
    bias = leaf(*bias_shape)
    mask = torch.rand(2, 1, 6, 9) > 0.3
    mask[0, 0, 2] = False  # a fully masked row
    check(lambda q, k, v, bias: sa.flash_attention(q, k, v, mask=mask, bias=bias, causal=True), (q, k, v, bias))


def test_flash_attention_varlen():
    lq, lk = [3, 0, 5], [4, 2, 5]
    cq, ck = cu_seqlens_of(lq), cu_seqlens_of(lk)
    q, k, v = leaf(sum(lq), 2, 3), leaf(sum(lk), 1, 3), leaf(sum(lk), 1, 2)
    check(lambda q, k, v: sa.flash_attention(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                             max_seqlen_q=5, max_seqlen_k=5), (q, k, v))


def test_combine():
    o = [leaf(1, 5, 3, 2) for _ in range(3)]
    g = [gates(1, 5, 3, requires_grad=True) for _ in range(3)]
    check(lambda *a: sa.combine(*a), (*o, *g))
    check(lambda o1, o3, g1, g3: sa.combine(o1, None, o3, g1, None, g3), (o[0], o[2], g[0], g[2]))


@pytest.mark.parametrize("branches", ["all", "cmp+slc", "slc", "swa"])
def test_nsa_attention(branches):
    T = 40
    q, k, v = leaf(1, T, 2, 4), leaf(1, T, 1, 4), leaf(1, T, 1, 4)
    gs = [gates(1, T, 2, requires_grad=True) for _ in range(3)]
    use = {"all": (1, 1, 1), "cmp+slc": (1, 1, 0), "slc": (0, 1, 0), "swa": (0, 0, 1)}[branches]
    cfg = sa.NSAConfig(**CFG)
    used = [g for g, u in zip(gs, use) if u]

    def fn(q, k, v, *gg):
        it = iter(gg)
        g3 = [next(it) if u else None for u in use]
        return sa.nsa_attention(q, k, v, *g3, config=cfg)

    check(fn, (q, k, v, *used))


def test_nsa_attention_user_compressed_kv():
    T = 40
    tc = (T - CMP) // STRIDE + 1
    q, k, v = leaf(1, T, 2, 4), leaf(1, T, 1, 4), leaf(1, T, 1, 4)
    kc, vc = leaf(1, tc, 1, 4), leaf(1, tc, 1, 4)
    gs = [gates(1, T, 2, requires_grad=True) for _ in range(3)]
    cfg = sa.NSAConfig(**CFG)
    check(lambda q, k, v, kc, vc, a, b, c: sa.nsa_attention(q, k, v, a, b, c, config=cfg, k_cmp=kc, v_cmp=vc),
          (q, k, v, kc, vc, *gs))


def test_nsa_attention_user_indices_packed(generator):
    lengths = [17, 23]
    cu = cu_seqlens_of(lengths)
    n = sum(lengths)
    q, k, v = leaf(n, 2, 4), leaf(n, 1, 4), leaf(n, 1, 4)
    gs = [gates(n, 2, requires_grad=True) for _ in range(3)]
    idx = torch.cat([random_indices(t, 1, 2, SEL, generator) for t in lengths])
    cfg = sa.NSAConfig(**CFG)
    check(lambda q, k, v, a, b, c: sa.nsa_attention(q, k, v, a, b, c, config=cfg, block_indices=idx,
                                                    cu_seqlens=cu, max_seqlen=23), (q, k, v, *gs))


def test_nsa_attention_packed_internal_selection():
    lengths = [17, 23]
    cu = cu_seqlens_of(lengths)
    n = sum(lengths)
    q, k, v = leaf(n, 2, 4), leaf(n, 1, 4), leaf(n, 1, 4)
    gs = [gates(n, 2, requires_grad=True) for _ in range(3)]
    cfg = sa.NSAConfig(**CFG)
    check(lambda q, k, v, a, b, c: sa.nsa_attention(q, k, v, a, b, c, config=cfg, cu_seqlens=cu),
          (q, k, v, *gs))
