"""sparseattn.compat: the drop-in wrappers with flash-attn's and fla's signatures, checked on the CPU against
naive float64 implementations of the other libraries' semantics (written here from their documentation)."""
import math

import pytest
import torch

import sparseattn
from sparseattn.compat import flash_attn_func, flash_attn_varlen_func, parallel_nsa


def _attend(q, k, v, keep, scale):
    """q [T, Hq, D], k/v [S, Hkv, D], keep [Hq|1, T, S] bool -> [T, Hq, Dv]; rows with no key give 0."""
    group = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, kh) * scale
    s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hts,shd->thd", p, vh)


def _fla_nsa_naive(q, k, v, g_cmp, g_slc, g_swa, indices, counts, bs, window, scale):
    """fla's NSA for one sequence: q [T, Hq, D], indices [T, Hkv, S] with counts (int), gates [T, Hq]."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    t = torch.arange(T)
    out = torch.zeros(T, Hq, v.shape[-1], dtype=q.dtype)
    if g_cmp is not None:
        nc = T // bs
        kc = k[: nc * bs].view(nc, bs, Hkv, D).mean(1)
        vc = v[: nc * bs].view(nc, bs, Hkv, -1).mean(1)
        keep = ((torch.arange(nc)[None, :] + 1) * bs - 1 <= t[:, None])[None]
        out += g_cmp[..., None] * _attend(q, kc, vc, keep, scale)
    keep = torch.zeros(Hq, T, T, dtype=torch.bool)
    for ti in range(T):
        for h in range(Hkv):
            for b in indices[ti, h, :counts].tolist():
                if b < 0:
                    continue
                lo, hi = b * bs, min(T, (b + 1) * bs)
                keep[h * group:(h + 1) * group, ti, lo:hi] = True
    keep &= (torch.arange(T)[None, :] <= t[:, None])[None]
    out += g_slc[..., None] * _attend(q, k, v, keep, scale)
    if window > 0:
        keep = ((torch.arange(T)[None, :] <= t[:, None]) & (torch.arange(T)[None, :] > t[:, None] - window))[None]
        out += g_swa[..., None] * _attend(q, k, v, keep, scale)
    return out


def _fla_indices(gen, T, Hkv, S, bs, pad):
    """fla-style indices: per token, up to S distinct causal blocks, padded with `pad`, sorted."""
    idx = torch.full((T, Hkv, S), pad, dtype=torch.long)
    for ti in range(T):
        for h in range(Hkv):
            chosen = torch.randperm(ti // bs + 1, generator=gen)[:S]
            idx[ti, h, : len(chosen)] = chosen
    return idx.sort(-1).values


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [0, 8])
def test_parallel_nsa_with_block_indices_matches_fla_semantics(group, window):
    gen = torch.Generator().manual_seed(group * 10 + window)
    T, Hkv, D, bs, S = 45, 2, 16, 8, 3
    Hq = Hkv * group
    q = torch.randn(1, T, Hq, D, dtype=torch.float64, generator=gen)
    k = torch.randn(1, T, Hkv, D, dtype=torch.float64, generator=gen)
    v = torch.randn(1, T, Hkv, D, dtype=torch.float64, generator=gen)
    g = [torch.rand(1, T, Hq, dtype=torch.float64, generator=gen) for _ in range(3)]
    idx = _fla_indices(gen, T, Hkv, S, bs, pad=T)  # fla pads with T (out of range)
    o = parallel_nsa(q, k, v, g[0], g[1], g[2], block_indices=idx[None], block_counts=S, block_size=bs,
                     window_size=window)
    ref = _fla_nsa_naive(q[0], k[0], v[0], g[0][0], g[1][0], g[2][0], idx, S, bs, window, D ** -0.5)
    torch.testing.assert_close(o[0], ref, rtol=1e-10, atol=1e-10)


def test_parallel_nsa_counts_below_the_slots_and_packed_sequences():
    gen = torch.Generator().manual_seed(3)
    lengths, Hkv, Hq, D, bs, S = [20, 33], 1, 2, 8, 4, 4
    cu = torch.tensor([0, 20, 53], dtype=torch.int64)
    N = sum(lengths)
    q = torch.randn(1, N, Hq, D, dtype=torch.float64, generator=gen)
    k = torch.randn(1, N, Hkv, D, dtype=torch.float64, generator=gen)
    v = torch.randn(1, N, Hkv, D, dtype=torch.float64, generator=gen)
    g_slc = torch.rand(1, N, Hq, dtype=torch.float64, generator=gen)
    counts = torch.randint(1, S + 1, (1, N, Hkv), generator=gen)
    idx = torch.cat([_fla_indices(gen, n, Hkv, S, bs, pad=-1) for n in lengths])
    o = parallel_nsa(q, k, v, None, g_slc, None, block_indices=idx[None], block_counts=counts, block_size=bs,
                     cu_seqlens=cu)
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for t in range(lo, hi):  # per token: its own count
            ref = _fla_nsa_naive(q[0, lo:t + 1], k[0, lo:t + 1], v[0, lo:t + 1], None, g_slc[0, lo:t + 1], None,
                                 idx[lo:t + 1], int(counts[0, t, 0]), bs, 0, D ** -0.5)
            torch.testing.assert_close(o[0, t], ref[-1], rtol=1e-10, atol=1e-10)


def test_parallel_nsa_selects_without_indices_and_gate_defaults():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 40, h, 16, generator=gen) for h in (4, 1, 1))
    g = torch.rand(1, 40, 4, generator=gen)
    o = parallel_nsa(q, k, v, g, None, None, block_counts=3, block_size=8)
    cfg = sparseattn.NSAConfig(cmp_block=8, cmp_stride=8, sel_block=8, num_selected=3, num_init=1, num_local=1,
                               window=1)
    expected = sparseattn.nsa_attention(q, k, v, g, torch.ones_like(g), None, config=cfg)
    torch.testing.assert_close(o, expected, rtol=0, atol=0)
    with pytest.raises(sparseattn.SparseAttnError, match="g_cmp"):
        parallel_nsa(q, k, v, None, g, None, block_counts=3, block_size=8)
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="block_counts"):
        parallel_nsa(q, k, v, g, g, None, block_counts=torch.ones(1, 40, 1, dtype=torch.long), block_size=8)


def test_flash_attn_func_and_varlen_match_flash_attention():
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 9, 4, 16, generator=gen), torch.randn(2, 12, 2, 16, generator=gen), torch.randn(
        2, 12, 2, 8, generator=gen)
    out, lse, probs = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(4, 1),
                                      return_attn_probs=True)
    o_ref, lse_ref = sparseattn.flash_attention(q, k, v, causal=True, window=(4, 1), scale=0.3, return_lse=True)
    assert probs is None
    torch.testing.assert_close(out, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)
    cu_q, cu_k = torch.tensor([0, 9, 18]), torch.tensor([0, 12, 24])
    packed = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 9, 12,
                                    softmax_scale=0.3, causal=True, window_size=(4, 1))
    torch.testing.assert_close(packed, o_ref.flatten(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"dropout_p": 0.1}, {"softcap": 30.0}, {"alibi_slopes": torch.ones(4)}])
def test_flash_attn_func_refuses_what_it_cannot_honour(kwargs):
    q = k = v = torch.randn(1, 4, 4, 16)
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match=next(iter(kwargs))):
        flash_attn_func(q, k, v, **kwargs)


def _rotate_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding one token at a time (float64)."""
    out = x.clone()
    rot = 2 * cos.shape[1]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            c, s = cos[positions[b][t]], sin[positions[b][t]]
            head = x[b, t, :, :rot]
            if interleaved:
                a, bb = head[:, 0::2], head[:, 1::2]
                out[b, t, :, :rot] = torch.stack((a * c - bb * s, a * s + bb * c), -1).flatten(-2)
            else:
                a, bb = head[:, : rot // 2], head[:, rot // 2:]
                out[b, t, :, :rot] = torch.cat((a * c - bb * s, a * s + bb * c), -1)
    return out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_flash_attn_with_kvcache_appends_and_attends(paged, rotary):
    from sparseattn.compat import flash_attn_with_kvcache
    gen = torch.Generator().manual_seed(6)
    B, Hq, Hkv, D, new, Tq, cap = 2, 4, 2, 16, 3, 3, 48
    lengths = torch.tensor([7, 30], dtype=torch.int32)
    dense_k = torch.randn(B, cap, Hkv, D, dtype=torch.float64, generator=gen)
    dense_v = torch.randn(B, cap, Hkv, D, dtype=torch.float64, generator=gen)
    q = torch.randn(B, Tq, Hq, D, dtype=torch.float64, generator=gen)
    k = torch.randn(B, new, Hkv, D, dtype=torch.float64, generator=gen)
    v = torch.randn(B, new, Hkv, D, dtype=torch.float64, generator=gen)
    cos = sin = None
    if rotary is not None:
        angles = torch.rand(64, 4, dtype=torch.float64, generator=gen) * 6
        cos, sin = angles.cos(), angles.sin()
    page = 16
    if paged:
        order = torch.randperm(B * cap // page, generator=gen)
        table = order.view(B, cap // page).int()
        k_cache = torch.empty(B * cap // page, page, Hkv, D, dtype=torch.float64)
        v_cache = torch.empty_like(k_cache)
        k_cache[order] = dense_k.view(-1, page, Hkv, D)
        v_cache[order] = dense_v.view(-1, page, Hkv, D)
    else:
        table, k_cache, v_cache = None, dense_k.clone(), dense_v.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=lengths, block_table=table, causal=True,
                                       rotary_interleaved=rotary == "interleaved", return_softmax_lse=True)
    positions = lengths.long()[:, None] + torch.arange(new)
    if rotary is not None:
        k = _rotate_reference(k, cos, sin, positions, rotary == "interleaved")
        q = _rotate_reference(q, cos, sin, positions, rotary == "interleaved")
    expected_k, expected_v = dense_k.clone(), dense_v.clone()
    for b in range(B):
        expected_k[b, positions[b]] = k[b]
        expected_v[b, positions[b]] = v[b]
    cached_k = k_cache[table.long()].flatten(1, 2) if paged else k_cache
    torch.testing.assert_close(cached_k, expected_k, rtol=0, atol=0)
    for b in range(B):
        end = int(lengths[b]) + new
        o_ref, lse_ref = sparseattn.flash_attention(q[b:b + 1], expected_k[b:b + 1, :end], expected_v[b:b + 1, :end],
                                                    causal=True, return_lse=True)
        torch.testing.assert_close(out[b:b + 1], o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b:b + 1], lse_ref, rtol=1e-12, atol=1e-12)


def test_flash_attn_with_kvcache_refuses_what_it_cannot_honour():
    from sparseattn.compat import flash_attn_with_kvcache
    q, cache = torch.randn(1, 1, 2, 16), torch.zeros(1, 8, 1, 16)
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, cache, cache, cache_batch_idx=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="1 to 16"):
        flash_attn_with_kvcache(torch.randn(1, 17, 2, 16), cache, cache)
    with pytest.raises(sparseattn.SparseAttnError, match="do not fit"):
        flash_attn_with_kvcache(q, cache, cache, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), cache_seqlens=7)
