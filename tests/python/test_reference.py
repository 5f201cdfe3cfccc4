"""sparseattn (CPU reference, float64) against the naive oracle: outputs, log-sum-exps, indices, gradients.

Both sides compute in float64 from the same inputs, so they agree to summation-order rounding (1e-10);
selection indices must be equal exactly (random float64 inputs make ties vanishingly rare; exact ties,
such as all-zero scores before the first compressed block, go to the lower index on both sides).
"""

import pytest
import torch

import naive_nsa as nv
from helpers import (assert_close64, cu_seqlens_of, gates, grads, indices_mismatch_report, leaf_clones, pack,
                     packed_lse_pieces, qkv, random_indices, randn, require_sparseattn, selection_gap_ok, unpack)

sa = require_sparseattn()

# Config families. TINY makes short sequences non-trivial (5 selection blocks at T = 65, n = 3, window 16).
TINY = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1, window=16)
SMALL = dict(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=5, num_init=1, num_local=2, window=64)
DEFAULT = dict()
DEFAULT_N6 = dict(num_selected=6)

GROUPS = [1, 2, 3, 4, 8, 16]
HEAD_DIMS = list(sa.CUDA_HEAD_DIMS)
SHORT = [1, 31, 32, 63, 64, 65]


def kv_heads(G):
    return 2 if G <= 4 else 1


def cfg_of(d):
    return sa.NSAConfig(**d)


# ----------------------------------------------------------------------------------------------- NSA


def compare_nsa(B, T, G, Dqk, Dv, cfg, *, user_cmp=False, user_idx=False, branches=(1, 1, 1), generator=None):
    Hkv = kv_heads(G)
    Hq = G * Hkv
    q, k, v = qkv(B, T, Hq, Hkv, Dqk, Dv)
    gs = [gates(B, T, Hq) if u else None for u in branches]
    kc = vc = idx = None
    if user_cmp:
        tc = nv.num_compressed_blocks(T, cfg.cmp_block, cfg.cmp_stride)
        kc, vc = randn(B, tc, Hkv, Dqk, scale=0.5), randn(B, tc, Hkv, Dv)
    if user_idx:
        idx = random_indices(T, Hkv, cfg.num_selected, cfg.sel_block, generator, batch=B)
    do = randn(B, T, Hq, Dv)

    inputs = [q, k, v, *[g for g in gs if g is not None]] + ([kc, vc] if user_cmp else [])
    outs = []
    for impl in ("sa", "naive"):
        leaves = leaf_clones(*inputs)
        lq, lk, lv = leaves[:3]
        it = iter(leaves[3:])
        lg = [next(it) if g is not None else None for g in gs]
        lkc, lvc = (next(it), next(it)) if user_cmp else (None, None)
        if impl == "sa":
            o = sa.nsa_attention(lq, lk, lv, *lg, config=cfg, k_cmp=lkc, v_cmp=lvc, block_indices=idx)
        else:
            o = nv.nsa_attention(lq, lk, lv, *lg, config=cfg, k_cmp=lkc, v_cmp=lvc, block_indices=idx)
        outs.append((o, grads(o, leaves, do)))
    (o_sa, g_sa), (o_nv, g_nv) = outs
    names = ["q", "k", "v"] + [n for n, g in zip(("g_cmp", "g_slc", "g_swa"), gs) if g is not None] + \
        (["k_cmp", "v_cmp"] if user_cmp else [])
    try:
        assert_close64(o_sa, o_nv, name="o")
        for n, a, b in zip(names, g_sa, g_nv):
            assert_close64(a, b, name=f"d{n}")
    except AssertionError as e:
        if user_idx or not branches[1]:
            raise
        # explain: does the internal selection differ from the naive one?
        ref = nv.nsa_indices(q, k, v, cfg, k_cmp=kc)
        kcs, vcs = (kc, vc) if user_cmp else sa.compress_kv(k, v, block=cfg.cmp_block, stride=cfg.cmp_stride)
        _, lse = sa.compressed_attention(q, kcs, vcs, block=cfg.cmp_block, stride=cfg.cmp_stride, scale=cfg.scale)
        got = sa.select_blocks(q, kcs, lse, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride,
                               sel_block=cfg.sel_block, num_selected=cfg.num_selected, num_init=cfg.num_init,
                               num_local=cfg.num_local, scale=cfg.scale)
        extra = "selection equals the naive one" if torch.equal(got, ref) else indices_mismatch_report(got, ref)
        raise AssertionError(f"{e}\n[{extra}]") from None


@pytest.mark.parametrize("T", SHORT)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
@pytest.mark.parametrize("G", GROUPS)
def test_nsa_matrix_tiny_config(G, dims, T):
    compare_nsa(1, T, G, dims[0], dims[1], cfg_of(TINY))


@pytest.mark.parametrize("T", [1, 63, 65, 200])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_nsa_small_config(G, T):
    compare_nsa(2, T, G, 64, 64, cfg_of(SMALL))


@pytest.mark.parametrize("T", [1, 31, 64, 65, 130])
def test_nsa_default_config(T):
    compare_nsa(1, T, 2, 128, 128, cfg_of(DEFAULT))


@pytest.mark.slow
@pytest.mark.parametrize("G,dims,cfg", [(2, (64, 64), SMALL), (4, (128, 128), DEFAULT_N6), (16, (64, 64), TINY),
                                        (1, (192, 128), DEFAULT)],
                         ids=["small-G2-d64", "defaultn6-G4-d128", "tiny-G16-d64", "default-G1-d192v128"])
def test_nsa_long(G, dims, cfg):
    compare_nsa(1, 1000, G, dims[0], dims[1], cfg_of(cfg))


@pytest.mark.parametrize("branches", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1)],
                         ids=lambda b: "".join(n for n, u in zip(("cmp", "slc", "swa"), b) if u))
def test_nsa_branch_subsets(branches):
    compare_nsa(1, 65, 2, 64, 64, cfg_of(TINY), branches=branches)


@pytest.mark.parametrize("T", [31, 65, 100])
def test_nsa_user_compressed_kv(T):
    compare_nsa(1, T, 2, 64, 32, cfg_of(TINY), user_cmp=True)


@pytest.mark.parametrize("T", [1, 65, 100])
def test_nsa_user_indices(T, generator):
    compare_nsa(2, T, 3, 64, 64, cfg_of(TINY), user_idx=True, generator=generator)


def test_nsa_explicit_scale():
    compare_nsa(1, 70, 2, 64, 64, cfg_of(dict(TINY, scale=0.3)))


# ------------------------------------------------------------------------------------- single ops


@pytest.mark.parametrize("T", SHORT + [1000])
@pytest.mark.parametrize("block,stride", [(32, 16), (16, 8), (8, 8)])
def test_compress_kv(block, stride, T):
    k, v = randn(2, T, 2, 64, requires_grad=True), randn(2, T, 2, 32, requires_grad=True)
    kc, vc = sa.compress_kv(k, v, block=block, stride=stride)
    rk, rv = nv.compress_kv(k, v, block=block, stride=stride)
    assert_close64(kc, rk, name="k_cmp")
    assert_close64(vc, rv, name="v_cmp")
    if kc.numel():
        dkc, dvc = torch.randn_like(kc), torch.randn_like(vc)
        for a, b, n in zip(grads((kc, vc), (k, v), (dkc, dvc)), grads((rk, rv), (k, v), (dkc, dvc)), "kv"):
            assert_close64(a, b, name=f"d{n}")


def compressed_inputs(B, T, G, Dqk, Dv, block, stride):
    Hkv = kv_heads(G)
    q = randn(B, T, G * Hkv, Dqk, requires_grad=True)
    tc = nv.num_compressed_blocks(T, block, stride)
    kc = randn(B, tc, Hkv, Dqk, requires_grad=True, scale=0.5)
    vc = randn(B, tc, Hkv, Dv, requires_grad=True)
    return q, kc, vc


@pytest.mark.parametrize("T", SHORT + [200])
@pytest.mark.parametrize("G", GROUPS)
def test_compressed_attention(G, T):
    q, kc, vc = compressed_inputs(1, T, G, 64, 64, 16, 8)
    o, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    ro, rlse = nv.compressed_attention(q, kc, vc, block=16, stride=8)
    assert_close64(o, ro, name="o")
    assert_close64(lse, rlse, name="lse")
    do = torch.randn_like(o)
    for a, b, n in zip(grads(o, (q, kc, vc), do), grads(ro, (q, kc, vc), do), ("q", "k_cmp", "v_cmp")):
        assert_close64(a, b, name=f"d{n}")


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_compressed_attention_head_dims(dims):
    q, kc, vc = compressed_inputs(2, 100, 2, dims[0], dims[1], 32, 16)
    o, lse = sa.compressed_attention(q, kc, vc)
    ro, rlse = nv.compressed_attention(q, kc, vc)
    assert_close64(o, ro, name="o")
    assert_close64(lse, rlse, name="lse")
    do = torch.randn_like(o)
    for a, b, n in zip(grads(o, (q, kc, vc), do), grads(ro, (q, kc, vc), do), ("q", "k_cmp", "v_cmp")):
        assert_close64(a, b, name=f"d{n}")


def check_selection(q, kc, lse, cfgd):
    c = nv.config_from(cfg_of(cfgd))
    kw = dict(cmp_block=c.cmp_block, cmp_stride=c.cmp_stride, sel_block=c.sel_block, num_selected=c.num_selected,
              num_init=c.num_init, num_local=c.num_local, scale=c.scale)
    got = sa.select_blocks(q, kc, lse, **kw)
    ref = nv.select_blocks(q, kc, lse, **kw)
    assert got.dtype == torch.int32 and got.shape == ref.shape
    if not torch.equal(got, ref):
        scores = nv.selection_scores(q, kc, lse, c.cmp_block, c.cmp_stride, c.sel_block, c.scale)
        ok, report = selection_gap_ok(got, ref, scores, rtol=1e-12)
        assert ok, indices_mismatch_report(got, ref) + "\n" + report


@pytest.mark.parametrize("T", [1, 31, 63, 64, 65, 200])
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("cfgd", [TINY, SMALL], ids=["tiny", "small"])
def test_select_blocks(cfgd, G, T):
    c = cfg_of(cfgd)
    q, kc, vc = compressed_inputs(2, T, G, 64, 64, c.cmp_block, c.cmp_stride)
    _, lse = nv.compressed_attention(q, kc, vc, block=c.cmp_block, stride=c.cmp_stride)
    check_selection(q.detach(), kc.detach(), lse.detach(), cfgd)


@pytest.mark.parametrize("cfgd", [SMALL, DEFAULT_N6, dict(DEFAULT, num_selected=5, num_init=2, num_local=1)],
                         ids=["small", "default-n6", "default-n5-init2-local1"])
def test_select_blocks_long(cfgd):
    c = cfg_of(cfgd)
    q, kc, vc = compressed_inputs(1, 1000, 4, 64, 64, c.cmp_block, c.cmp_stride)
    _, lse = nv.compressed_attention(q, kc, vc, block=c.cmp_block, stride=c.cmp_stride)
    check_selection(q.detach(), kc.detach(), lse.detach(), cfgd)


def test_select_blocks_uses_given_lse_and_mean_compression():
    """The whole pipeline as separate ops: compress -> compressed attention -> select == naive selection."""
    q, k, v = qkv(2, 300, 4, 2, 64)
    c = cfg_of(SMALL)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    _, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    got = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=5)
    ref = nv.nsa_indices(q, k, v, c)
    assert torch.equal(got, ref), indices_mismatch_report(got, ref)


def selected_inputs(B, T, G, Dqk, Dv):
    Hkv = kv_heads(G)
    q = randn(B, T, G * Hkv, Dqk, requires_grad=True)
    k = randn(B, T, Hkv, Dqk, requires_grad=True)
    v = randn(B, T, Hkv, Dv, requires_grad=True)
    return q, k, v


def check_selected(q, k, v, idx, block, scale=None):
    o, lse = sa.selected_attention(q, k, v, idx, block=block, scale=scale)
    ro, rlse = nv.selected_attention(q, k, v, idx, block=block, scale=scale)
    assert_close64(o, ro, name="o")
    assert_close64(lse, rlse, name="lse")
    do = torch.randn_like(o)
    for a, b, n in zip(grads(o, (q, k, v), do), grads(ro, (q, k, v), do), "qkv"):
        assert_close64(a, b, name=f"d{n}")


@pytest.mark.parametrize("T", SHORT + [130])
@pytest.mark.parametrize("G", GROUPS)
def test_selected_attention(G, T, generator):
    q, k, v = selected_inputs(1, T, G, 64, 64)
    idx = random_indices(T, kv_heads(G), 3, 16, generator, batch=1)
    check_selected(q, k, v, idx, 16)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_selected_attention_head_dims(dims, generator):
    q, k, v = selected_inputs(2, 150, 2, *dims)
    idx = random_indices(150, 2, 2, 64, generator, batch=2)
    check_selected(q, k, v, idx, 64, scale=0.1)


def test_selected_attention_empty_rows(generator):
    """Rows whose index list is all -1 attend to nothing: o = 0, lse = -inf, no gradient."""
    q, k, v = selected_inputs(1, 70, 2, 64, 64)
    idx = random_indices(70, 2, 2, 16, generator, batch=1, allow_empty=True)
    idx[0, 0] = -1
    check_selected(q, k, v, idx, 16)
    o, lse = sa.selected_attention(q, k, v, idx, block=16)
    assert (o[0, 0] == 0).all() and torch.isneginf(lse[0, :, 0]).all()


@pytest.mark.slow
def test_selected_attention_long(generator):
    q, k, v = selected_inputs(1, 1000, 2, 128, 128)
    idx = random_indices(1000, 2, 8, 64, generator, batch=1)
    check_selected(q, k, v, idx, 64)


def test_combine():
    os_ = [randn(2, 33, 4, 16, requires_grad=True) for _ in range(3)]
    gs = [gates(2, 33, 4, requires_grad=True) for _ in range(3)]
    o = sa.combine(*os_, *gs)
    ro = nv.combine(*os_, *gs)
    assert_close64(o, ro)
    do = torch.randn_like(o)
    for a, b in zip(grads(o, os_ + gs, do), grads(ro, os_ + gs, do)):
        assert_close64(a, b)


# ----------------------------------------------------------------------------------- varlen = batched

LENGTHS = [1, 31, 0, 65, 100, 64, 17]


def test_varlen_compress_and_compressed_attention():
    lengths = LENGTHS
    Tm = max(lengths)
    q, k, v = qkv(len(lengths), Tm, 4, 2, 64)
    cu = cu_seqlens_of(lengths)
    qp, kp, vp = pack(q, lengths, 5), pack(k, lengths, 5), pack(v, lengths, 5)
    kc, vc = sa.compress_kv(kp, vp, block=16, stride=8, cu_seqlens=cu)
    ccu = sa.compressed_cu_seqlens(cu, block=16, stride=8)
    assert kc.shape[0] == qp.shape[0] // 8
    o, lse = sa.compressed_attention(qp, kc, vc, block=16, stride=8, cu_seqlens=cu, cu_seqlens_cmp=ccu)
    idx = sa.select_blocks(qp, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3,
                           cu_seqlens=cu, cu_seqlens_cmp=ccu)
    cb = ccu.tolist()
    for b, n in enumerate(lengths):
        kcb, vcb = sa.compress_kv(k[b : b + 1, :n], v[b : b + 1, :n], block=16, stride=8)
        assert_close64(kc[cb[b] : cb[b + 1]], kcb[0], name=f"k_cmp[{b}]")
        assert_close64(vc[cb[b] : cb[b + 1]], vcb[0], name=f"v_cmp[{b}]")
        ob, lseb = sa.compressed_attention(q[b : b + 1, :n], kcb, vcb, block=16, stride=8)
        assert_close64(unpack(o, lengths)[b], ob[0], name=f"o[{b}]")
        assert_close64(packed_lse_pieces(lse, lengths)[b], lseb[0], name=f"lse[{b}]")
        ib = sa.select_blocks(q[b : b + 1, :n], kcb, lseb, cmp_block=16, cmp_stride=8, sel_block=32,
                              num_selected=3)
        assert torch.equal(unpack(idx, lengths)[b], ib[0]), f"indices of sequence {b}"
    # and against the naive packed implementation
    rkc, rvc = nv.compress_kv(kp, vp, block=16, stride=8, cu_seqlens=cu)
    rows = cb[-1]
    assert_close64(kc[:rows], rkc[:rows], name="k_cmp")
    ro, rlse = nv.compressed_attention(qp, kc, vc, block=16, stride=8, cu_seqlens=cu)
    n = int(cu[-1])
    assert_close64(o[:n], ro[:n], name="o")
    assert_close64(lse[:, :n], rlse[:, :n], name="lse")


def test_varlen_selected_attention(generator):
    lengths = LENGTHS
    cu = cu_seqlens_of(lengths)
    n = sum(lengths)
    q, k, v = randn(n, 4, 64, requires_grad=True), randn(n, 2, 64, requires_grad=True), \
        randn(n, 2, 32, requires_grad=True)
    idx = torch.cat([random_indices(t, 2, 3, 16, generator) for t in lengths])
    o, lse = sa.selected_attention(q, k, v, idx, block=16, cu_seqlens=cu)
    ro, rlse = nv.selected_attention(q, k, v, idx, block=16, cu_seqlens=cu)
    assert_close64(o, ro, name="o")
    assert_close64(lse, rlse, name="lse")
    do = torch.randn_like(o)
    for a, b, nm in zip(grads(o, (q, k, v), do), grads(ro, (q, k, v), do), "qkv"):
        assert_close64(a, b, name=f"d{nm}")


@pytest.mark.parametrize("cfgd,lengths", [(TINY, LENGTHS), (SMALL, LENGTHS), (DEFAULT_N6, [1000, 1, 63, 0, 129])],
                         ids=["tiny", "small", "default-n6-long"])
@pytest.mark.parametrize("user_cmp", [False, True], ids=["mean", "user-cmp"])
def test_varlen_nsa_equals_batched(cfgd, lengths, user_cmp):
    cfg = cfg_of(cfgd)
    B, Tm, Hq, Hkv, D = len(lengths), max(lengths), 4, 2, 64
    q, k, v = qkv(B, Tm, Hq, Hkv, D)
    gs = [gates(B, Tm, Hq) for _ in range(3)]
    cu = cu_seqlens_of(lengths)
    ccu = sa.compressed_cu_seqlens(cu, block=cfg.cmp_block, stride=cfg.cmp_stride)
    N = sum(lengths)
    kc_p = vc_p = None
    if user_cmp:
        kc_p, vc_p = randn(N // cfg.cmp_stride, Hkv, D), randn(N // cfg.cmp_stride, Hkv, D)
    packed = [pack(x, lengths) for x in (q, k, v, *gs)] + ([kc_p, vc_p] if user_cmp else [])
    leaves = leaf_clones(*packed)
    o = sa.nsa_attention(*leaves[:6], config=cfg, cu_seqlens=cu, max_seqlen=Tm,
                         k_cmp=leaves[6] if user_cmp else None, v_cmp=leaves[7] if user_cmp else None)
    do = randn(*o.shape)
    g_p = grads(o, leaves, do)
    cb = ccu.tolist()
    s = 0
    for b, t in enumerate(lengths):
        sl = slice(s, s + t)
        s += t
        csl = slice(cb[b], cb[b + 1])
        parts = [x[sl][None] for x in packed[:6]] + ([packed[6][csl][None], packed[7][csl][None]] if user_cmp else [])
        lb = leaf_clones(*parts)
        ob = sa.nsa_attention(*lb[:6], config=cfg, k_cmp=lb[6] if user_cmp else None,
                              v_cmp=lb[7] if user_cmp else None)
        assert_close64(o[sl], ob[0], name=f"o[{b}]")
        gb = grads(ob, lb, do[sl][None])
        names = ["q", "k", "v", "g_cmp", "g_slc", "g_swa", "k_cmp", "v_cmp"]
        for i, (gp, gbb) in enumerate(zip(g_p, gb)):
            piece = gp[csl] if i >= 6 else gp[sl]
            assert_close64(piece, gbb[0], name=f"d{names[i]}[{b}]")
    # rows of user k_cmp/v_cmp past the last compressed sequence get no gradient
    if user_cmp:
        assert (g_p[6][cb[-1]:] == 0).all() and (g_p[7][cb[-1]:] == 0).all()
    # and the naive packed pipeline
    ro = nv.nsa_attention(*packed[:6], config=cfg, cu_seqlens=cu,
                          k_cmp=packed[6] if user_cmp else None, v_cmp=packed[7] if user_cmp else None)
    assert_close64(o, ro, name="o (naive)")
