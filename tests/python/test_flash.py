"""flash_attention (CPU reference, float64) against the naive dense oracle: causal (bottom-right), window,
mask, bias (with dbias reduced to the bias's shape), GQA, S != T, varlen, fully masked rows."""

import pytest
import torch

import naive_nsa as nv
from helpers import (assert_close64, cu_seqlens_of, grads, leaf_clones, pack, packed_lse_pieces, qkv, randn,
                     require_sparseattn, unpack)

sa = require_sparseattn()


def compare(q, k, v, *, bias=None, **kw):
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    res = []
    for fn in (sa.flash_attention, nv.flash_attention):
        leaves = leaf_clones(*inputs)
        b = leaves[3] if bias is not None else None
        o, lse = fn(*leaves[:3], bias=b, return_lse=True, **kw)
        res.append((o, lse, leaves))
    (o, lse, la), (ro, rlse, lb) = res
    assert_close64(o, ro, name="o")
    assert_close64(lse, rlse, name="lse")
    do = torch.randn_like(o)
    for n, a, b in zip(["q", "k", "v", "bias"], grads(o, la, do), grads(ro, lb, do)):
        assert_close64(a, b, name=f"d{n}")
    return o, lse


@pytest.mark.parametrize("T,S", [(1, 1), (31, 31), (64, 64), (65, 65), (5, 70), (70, 5), (33, 64)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (15, 0)),
                                           (False, (7, 3)), (False, (-1, 4)), (True, (0, 0))])
def test_causal_window(T, S, causal, window):
    q, k, v = qkv(2, T, 4, 2, 32, S=S)
    compare(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("G", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("T", [1, 63, 65])
def test_groups(G, T):
    Hkv = 2 if G <= 4 else 1
    q, k, v = qkv(1, T, G * Hkv, Hkv, 64)
    compare(q, k, v, causal=True)


@pytest.mark.parametrize("dims", sa.CUDA_HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_head_dims(dims):
    q, k, v = qkv(2, 40, 4, 2, dims[0], dims[1], S=50)
    compare(q, k, v, causal=True, window=(20, 0), scale=0.05)


MASK_SHAPES = [(2, 4, 9, 13), (1, 1, 9, 13), (2, 2, 1, 13), (1, 4, 9, 13), (2, 1, 9, 13)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mask(shape):
    q, k, v = qkv(2, 9, 4, 2, 16, S=13)
    mask = torch.rand(shape) > 0.4
    compare(q, k, v, mask=mask)


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bias_and_dbias(shape):
    q, k, v = qkv(2, 9, 4, 2, 16, S=13)
    bias = randn(*shape)
    compare(q, k, v, bias=bias, causal=True)


def test_mask_bias_window_together():
    q, k, v = qkv(2, 30, 6, 3, 16, S=30)
    mask = torch.rand(2, 3, 30, 30) > 0.2
    bias = randn(1, 6, 30, 30)
    compare(q, k, v, mask=mask, bias=bias, causal=True, window=(10, 0))


def test_fully_masked_rows():
    q, k, v = qkv(1, 6, 2, 1, 16)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 1, :] = False
    mask[..., 4, :] = False
    o, lse = compare(q, k, v, mask=mask)
    assert (o[:, [1, 4]] == 0).all()
    assert torch.isneginf(lse[:, :, [1, 4]]).all()
    # causal with T > S leaves the first T - S rows without keys
    q, k, v = qkv(1, 8, 2, 1, 16, S=5)
    o, lse = compare(q, k, v, causal=True)
    assert (o[:, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()


def test_fully_masked_row_gradients_are_zero():
    q, k, v = qkv(1, 6, 2, 1, 16, requires_grad=True)
    bias = randn(1, 1, 6, 6, requires_grad=True)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    o = sa.flash_attention(q, k, v, mask=mask, bias=bias)
    o.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, 2] == 0).all()
    assert (bias.grad[..., 2, :] == 0).all() and torch.isfinite(bias.grad).all()


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, 0))])
def test_varlen(causal, window):
    lq = [1, 31, 0, 65, 7]
    lk = [1, 40, 3, 65, 2]
    cq, ck = cu_seqlens_of(lq), cu_seqlens_of(lk)
    Hq, Hkv, D = 4, 2, 32
    q = randn(sum(lq) + 3, Hq, D)
    k, v = randn(sum(lk), Hkv, D), randn(sum(lk), Hkv, 16)
    kw = dict(causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)
    leaves = leaf_clones(q, k, v)
    o, lse = sa.flash_attention(*leaves, return_lse=True, max_seqlen_q=max(lq), max_seqlen_k=max(lk), **kw)
    rleaves = leaf_clones(q, k, v)
    ro, rlse = nv.flash_attention(*rleaves, return_lse=True, **kw)
    n = sum(lq)
    assert_close64(o[:n], ro[:n], name="o")
    assert_close64(lse[:, :n], rlse[:, :n], name="lse")
    do = torch.randn_like(o)
    do[n:] = 0
    for nm, a, b in zip("qkv", grads(o, leaves, do), grads(ro, rleaves, do)):
        sl = slice(0, n) if nm == "q" else slice(None)
        assert_close64(a[sl], b[sl], name=f"d{nm}")
    # each sequence equals the batched call on it
    for b, (tq, tk) in enumerate(zip(lq, lk)):
        if tq == 0:
            continue
        qb = unpack(q, lq)[b][None]
        kb, vb = unpack(k, lk)[b][None], unpack(v, lk)[b][None]
        ob, lseb = sa.flash_attention(qb, kb, vb, causal=causal, window=window, return_lse=True)
        assert_close64(unpack(o, lq)[b], ob[0], name=f"o[{b}]")
        assert_close64(packed_lse_pieces(lse, lq)[b], lseb[0], name=f"lse[{b}]")


@pytest.mark.slow
def test_long():
    q, k, v = qkv(1, 1000, 4, 2, 64)
    compare(q, k, v, causal=True, window=(511, 0))


def test_packed_equals_batched_same_lengths():
    q, k, v = qkv(3, 20, 2, 2, 16)
    cu = cu_seqlens_of([20, 20, 20])
    o = sa.flash_attention(pack(q, [20] * 3), pack(k, [20] * 3), pack(v, [20] * 3), causal=True, cu_seqlens_q=cu,
                           cu_seqlens_k=cu)
    ob = sa.flash_attention(q, k, v, causal=True)
    assert_close64(o, ob.reshape(60, 2, 16))
