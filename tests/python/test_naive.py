"""Self-checks of the naive oracle (naive_nsa.py) against hand-computed cases and torch's SDPA.

These need only torch, so they run even when sparseattn is not built.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import naive_nsa as nv
from helpers import assert_close, assert_close64, cu_seqlens_of, pack, qkv, randn


def sdpa(q, k, v, mask=None, scale=None):
    """torch SDPA on [B, T, H, D] tensors (GQA by repeat)."""
    G = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(G, dim=2)
    v = v.repeat_interleave(G, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def test_stable_descending_sort_keeps_lower_index_first():
    x = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 1.0])
    order = torch.sort(x, descending=True, stable=True).indices.tolist()
    assert order == [1, 2, 4, 0, 5, 3]


def test_num_blocks():
    assert [nv.num_compressed_blocks(t, 32, 16) for t in (0, 1, 31, 32, 47, 48, 63, 64, 1000)] == \
        [0, 0, 0, 1, 1, 2, 2, 3, 61]
    assert [nv.num_selection_blocks(t, 64) for t in (0, 1, 63, 64, 65, 1000)] == [0, 1, 1, 1, 2, 16]
    cu = cu_seqlens_of([0, 1, 31, 32, 48, 100])
    assert nv.compressed_cu_seqlens(cu).tolist() == [0, 0, 0, 0, 1, 3, 8]


def test_overlap_weights_paper_defaults():
    # (l, d, l') = (32, 16, 64): selection block b gets weights 1, 2, 2, 2, 1 on j = 4b-1 .. 4b+3.
    w = nv.overlap_weights(20, 5, 32, 16, 64)
    for b in range(1, 4):
        col = w[:, b]
        assert col[4 * b - 1 : 4 * b + 4].tolist() == [1, 2, 2, 2, 1]
        assert col.sum().item() == 8  # l'/d * l/d = 4 * 2
        assert (col[: 4 * b - 1] == 0).all() and (col[4 * b + 4 :] == 0).all()
    assert w[:4, 0].tolist() == [2, 2, 2, 1]


def test_compress_means():
    k = randn(1, 50, 2, 3)
    kc, vc = nv.compress_kv(k, k, block=8, stride=4)
    assert kc.shape == (1, 11, 2, 3)
    for j in range(11):
        assert_close64(kc[0, j], k[0, 4 * j : 4 * j + 8].mean(0))


def test_masked_attention_full_equals_sdpa():
    q, k, v = qkv(2, 9, 4, 2, 5, 3)
    o = nv.flash_attention(q, k, v)
    assert_close64(o, sdpa(q, k, v))


@pytest.mark.parametrize("T,S", [(7, 7), (5, 9), (9, 5)])
def test_causal_bottom_right(T, S):
    q, k, v = qkv(1, T, 2, 1, 4, S=S)
    o, lse = nv.flash_attention(q, k, v, causal=True, return_lse=True)
    keep = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + S - T
    ref = sdpa(q, k, v, mask=keep) if keep.any(-1).all() else None
    rows = keep.any(-1)
    if ref is not None:
        assert_close64(o, ref)
    else:  # rows with no key (T > S): zeros and -inf
        assert (o[:, ~rows] == 0).all() and torch.isneginf(lse[:, :, ~rows]).all()
        sub = sdpa(q[:, rows], k, v, mask=keep[rows])
        assert_close64(o[:, rows], sub)


def test_fully_masked_row_zero_and_no_nan_grad():
    q, k, v = qkv(1, 4, 2, 2, 3, requires_grad=True)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2, :] = False
    o, lse = nv.flash_attention(q, k, v, mask=mask, return_lse=True)
    assert (o[:, 2] == 0).all() and torch.isneginf(lse[:, :, 2]).all()
    o.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, 2] == 0).all()


def test_bias_grad_reduces_to_bias_shape():
    q, k, v = qkv(2, 5, 4, 2, 3)
    bias = randn(1, 2, 1, 5, requires_grad=True)
    o = nv.flash_attention(q, k, v, bias=bias)
    o.sum().backward()
    assert bias.grad.shape == bias.shape
    # same bias given per query head, expanded by hand
    full = bias.detach().repeat_interleave(2, dim=1).expand(2, 4, 5, 5)
    assert_close64(o, nv.flash_attention(q, k, v, bias=full))


def test_compressed_visibility_and_empty_rows():
    q = randn(1, 40, 2, 4, requires_grad=True)
    k, v = randn(1, 40, 1, 4), randn(1, 40, 1, 4)
    kc, vc = nv.compress_kv(k, v, block=8, stride=4)
    o, lse = nv.compressed_attention(q, kc, vc, block=8, stride=4)
    assert (o[0, :7] == 0).all() and torch.isneginf(lse[0, :, :7]).all()
    assert torch.isfinite(lse[0, :, 7:]).all()
    # query 11 sees blocks 0 and 1 only (j*4 + 7 <= 11)
    s = torch.einsum("hd,jd->hj", q[0, 11], kc[0, :2, 0]) / 2.0
    assert_close64(lse[0, :, 11], torch.logsumexp(s, -1))
    o.sum().backward()
    assert (q.grad[0, :7] == 0).all()


def test_selection_forced_ties_and_padding():
    # scores all equal: the forced blocks, then the lowest indices
    T, l = 300, 32
    nsel = nv.num_selection_blocks(T, l)
    scores = torch.zeros(1, T, nsel, dtype=torch.float64)
    idx = nv.select_from_scores(scores, l, num_selected=4, num_init=1, num_local=2)
    assert idx.shape == (T, 1, 4) and idx.dtype == torch.int32
    assert idx[0, 0].tolist() == [0, -1, -1, -1]
    assert idx[40, 0].tolist() == [0, 1, -1, -1]
    assert idx[70, 0].tolist() == [0, 1, 2, -1]
    assert idx[299, 0].tolist() == [0, 1, 8, 9]  # init 0, local 8-9, tie -> 1
    # a high score wins over lower-index zeros; forced blocks stay
    scores[0, 299, 5] = 1.0
    scores[0, 299, 3] = 0.5
    idx = nv.select_from_scores(scores, l, num_selected=4, num_init=1, num_local=2)
    assert idx[299, 0].tolist() == [0, 5, 8, 9]
    idx = nv.select_from_scores(scores, l, num_selected=5, num_init=1, num_local=2)
    assert idx[299, 0].tolist() == [0, 3, 5, 8, 9]


def test_selection_contains_forced_blocks_random():
    q, k, v = qkv(1, 200, 4, 2, 8)
    cfg = nv.Config(16, 8, 32, 4, 1, 2, 64)
    idx = nv.nsa_indices(q, k, v, cfg)
    for t in range(200):
        cur = t // 32
        for h in range(2):
            row = idx[0, t, h].tolist()
            valid = [b for b in row if b >= 0]
            assert valid == sorted(set(valid)) and all(b <= cur for b in valid)
            assert len(valid) == min(4, cur + 1)
            assert row[len(valid):] == [-1] * (4 - len(valid))
            assert 0 in valid and cur in valid and (cur < 1 or cur - 1 in valid)


def test_selected_attention_all_blocks_is_causal():
    q, k, v = qkv(1, 70, 4, 2, 6)
    n = nv.num_selection_blocks(70, 16)
    idx = torch.arange(n, dtype=torch.int32).expand(1, 70, 2, n).contiguous()
    o, _ = nv.selected_attention(q, k, v, idx, block=16)
    assert_close64(o, nv.flash_attention(q, k, v, causal=True))


def test_sliding_window():
    q, k, v = qkv(1, 20, 2, 1, 4)
    o = nv.sliding_window_seq(q[0], k[0], v[0], 5, 0.5)[0][None]
    keep = (torch.arange(20)[None] <= torch.arange(20)[:, None]) & \
        (torch.arange(20)[None] > torch.arange(20)[:, None] - 5)
    assert_close64(o[0], sdpa(q, k, v, mask=keep, scale=0.5)[0])
    assert_close64(o[0], nv.flash_attention(q, k, v, causal=True, window=(4, 0), scale=0.5)[0])


def test_nsa_single_branches_and_packed():
    cfg = nv.Config(16, 8, 32, 4, 1, 2, 24)
    lengths = [1, 40, 0, 77]
    T = max(lengths)
    q, k, v = qkv(len(lengths), T, 4, 2, 8)
    one = torch.ones(len(lengths), T, 4, dtype=torch.float64)
    o_swa = nv.nsa_attention(q, k, v, None, None, one, cfg)
    assert_close64(o_swa, nv.flash_attention(q, k, v, causal=True, window=(23, 0)))
    o_all, ex = nv.nsa_attention(q, k, v, one, one, one, cfg, return_extras=True)
    assert "indices" in ex[0]
    cu = cu_seqlens_of(lengths)
    o_p = nv.nsa_attention(pack(q, lengths), pack(k, lengths), pack(v, lengths), pack(one, lengths),
                           pack(one, lengths), pack(one, lengths), cfg, cu_seqlens=cu)
    for b, (s, e) in enumerate(nv.seq_bounds(cu)):
        n = e - s
        ref = nv.nsa_attention(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], one[b : b + 1, :n],
                               one[b : b + 1, :n], one[b : b + 1, :n], cfg)
        assert_close64(o_p[s:e], ref[0])


def test_naive_scale_default():
    q, k, v = qkv(1, 3, 1, 1, 16)
    assert_close64(nv.flash_attention(q, k, v), nv.flash_attention(q, k, v, scale=1 / math.sqrt(16)))
    assert not torch.allclose(nv.flash_attention(q, k, v), nv.flash_attention(q, k, v, scale=1.0))


def test_assert_close_flags_inf_mismatch():
    a = torch.tensor([0.0, float("-inf")])
    with pytest.raises(AssertionError):
        assert_close(a, torch.tensor([0.0, 0.0]), atol=1.0)
