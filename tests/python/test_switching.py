"""sparseattn behaviour that docs/semantics.md section 9 (switching from other NSA implementations) relies on.

CPU only, float64. Each test pins one statement of that section about sparseattn itself (not about the peers).
"""

import math

import torch

from helpers import cu_seqlens_of, raises_arg, randn, require_sparseattn

sa = require_sparseattn()


def direct_attention(q, k, v, t, keys, scale):
    """o of query t (heads of one KV head's group, batched layout, B = 1, Hkv = 1) over the listed key positions."""
    s = torch.einsum("hd,nd->hn", q[0, t], k[0, keys, 0]) * scale
    return torch.softmax(s, -1) @ v[0, keys, 0]


def test_peer_window_w_is_window_w_plus_1():
    """FlashAttention's causal window_size=(w, -1) or (w, 0), as flash-nsa, FSA and nsa-triton pass it, keeps
    keys [t - w, t]: w + 1 keys, which is sparseattn's window = w + 1 (and flash_attention's (w, 0))."""
    T, w, D = 40, 5, 16
    q, k, v = randn(1, T, 2, D), randn(1, T, 1, D), randn(1, T, 1, D)
    g = torch.ones(1, T, 2, dtype=torch.float64)
    o_nsa = sa.nsa_attention(q, k, v, g_swa=g, config=sa.NSAConfig(window=w + 1))
    o_flash = sa.flash_attention(q, k, v, causal=True, window=(w, 0))
    torch.testing.assert_close(o_nsa, o_flash, rtol=0, atol=1e-12)
    for t in (0, 3, 5, 6, 39):
        keys = list(range(max(0, t - w), t + 1))
        torch.testing.assert_close(o_nsa[0, t], direct_attention(q, k, v, t, keys, 1 / math.sqrt(D)),
                                   rtol=0, atol=1e-12)


def test_padded_selection_rows_hold_block_0():
    """A row that select_blocks pads with -1 holds every candidate, block 0 included, even with num_init = 0:
    a peer reference that reads -1 as block 0 sees the same blocks for sparseattn's own selections."""
    q, k = randn(2, 300, 4, 16), randn(2, 300, 2, 16)
    for l, d, lp, n, num_init, num_local in [(32, 16, 64, 6, 0, 0), (32, 16, 64, 6, 0, 2), (16, 16, 32, 4, 0, 1),
                                              (64, 64, 64, 3, 0, 0), (32, 16, 64, 4, 1, 2)]:
        k_cmp, _ = sa.compress_kv(k, k, block=l, stride=d)
        _, lse = sa.compressed_attention(q, k_cmp, k_cmp, block=l, stride=d)
        idx = sa.select_blocks(q, k_cmp, lse, cmp_block=l, cmp_stride=d, sel_block=lp, num_selected=n,
                               num_init=num_init, num_local=num_local)
        padded = (idx == -1).any(-1)
        assert padded.any()
        assert (idx == 0).any(-1)[padded].all(), (l, d, lp, n, num_init, num_local)


def test_minus_one_pads_and_is_not_block_0():
    """Given indices [3, -1] at t = 200 (l' = 64) attend to tokens 192..200 only, not to block 0 as well."""
    T, D = 256, 16
    q, k, v = randn(1, T, 2, D), randn(1, T, 1, D), randn(1, T, 1, D)
    idx = torch.full((1, T, 1, 2), -1, dtype=torch.int32)
    idx[0, :, 0, 0] = torch.arange(T) // 64
    o, _ = sa.selected_attention(q, k, v, idx, block=64)
    scale = 1 / math.sqrt(D)
    torch.testing.assert_close(o[0, 200], direct_attention(q, k, v, 200, list(range(192, 201)), scale),
                               rtol=0, atol=1e-12)
    with_block_0 = direct_attention(q, k, v, 200, list(range(64)) + list(range(192, 201)), scale)
    assert not torch.allclose(o[0, 200], with_block_0)


def fla_mean_pooling(x, lengths, block):
    """fla's mean_pooling, packed: ceil(T / block) rows per sequence, the last one the mean of the leftover."""
    rows, start = [], 0
    for T in lengths:
        rows += [x[start + c:start + min(c + block, T)].mean(0) for c in range(0, T, block)]
        start += T
    return torch.stack(rows)


def test_fla_ceil_compressed_rows():
    """With l = d = 64, T = 100 has 1 compressed block in sparseattn (fla: 2 rows). A batched [B, 2, H, D]
    k_cmp is rejected; a packed fla k_cmp passes the checks but is misread until its partial rows are dropped."""
    cfg = sa.NSAConfig(cmp_block=64, cmp_stride=64, sel_block=64, num_selected=2, num_init=1, num_local=1, window=16)
    kb = randn(1, 100, 1, 8)
    k_cmp, _ = sa.compress_kv(kb, kb, block=64, stride=64)
    assert k_cmp.shape == (1, 1, 1, 8)
    g = torch.ones(1, 100, 16, dtype=torch.float64)
    two_rows = torch.stack([kb[0, :64].mean(0), kb[0, 64:].mean(0)])[None]
    with raises_arg(sa.SparseAttnError, "k_cmp"):
        sa.nsa_attention(randn(1, 100, 16, 8), kb, kb, g_cmp=g, config=cfg, k_cmp=two_rows, v_cmp=two_rows)

    lengths = [100, 20, 64]
    cu = cu_seqlens_of(lengths)
    assert sa.compressed_cu_seqlens(cu, 64, 64).tolist() == [0, 1, 1, 2]
    q, k, v = randn(184, 16, 8), randn(184, 1, 8), randn(184, 1, 8)
    g = torch.ones(184, 16, dtype=torch.float64)
    k_fla, v_fla = fla_mean_pooling(k, lengths, 64), fla_mean_pooling(v, lengths, 64)
    assert k_fla.shape[0] == 4  # fla's rows start at [0, 2, 3, 4]
    own = sa.nsa_attention(q, k, v, g_cmp=g, config=cfg, cu_seqlens=cu)
    as_is = sa.nsa_attention(q, k, v, g_cmp=g, config=cfg, k_cmp=k_fla, v_cmp=v_fla, cu_seqlens=cu)
    assert not torch.allclose(as_is, own)
    keep = [0, 3]  # the first floor(T / 64) rows of each sequence
    dropped = sa.nsa_attention(q, k, v, g_cmp=g, config=cfg, k_cmp=k_fla[keep], v_cmp=v_fla[keep], cu_seqlens=cu)
    torch.testing.assert_close(dropped, own, rtol=0, atol=1e-12)
