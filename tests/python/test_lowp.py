"""float16 / bfloat16 inputs: the ops run, return the input dtype (fp32 log-sum-exp), and are close to float64.

Tolerance (architecture brief): the error of sparseattn against a float64 oracle fed the SAME rounded inputs
must be at most twice the error of the same math done by PyTorch in the input precision (the naive oracle
run in fp16/bf16), plus one unit of rounding of the output's magnitude. Input rounding is excluded on both
sides because the oracle sees the rounded inputs.
"""

import pytest
import torch

import naive_nsa as nv
from helpers import cu_seqlens_of, gates, grads, leaf_clones, max_err, qkv, random_indices, randn, \
    require_sparseattn, selection_gap_ok, indices_mismatch_report

sa = require_sparseattn()

LOWP = [torch.float16, torch.bfloat16]
EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
TINY = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1, window=16)


def lowp_bound(ref, base, dtype):
    return 2.0 * max_err(base, ref) + EPS[dtype] * ref.detach().abs().nan_to_num(0, 0, 0).max().item()


def assert_lowp(got, ref, base, dtype, name, rows=None):
    """got: sparseattn in dtype; ref: float64 oracle on the rounded inputs; base: the oracle run in dtype."""
    assert got.dtype == base.dtype, f"{name}: dtype {got.dtype}, expected {base.dtype}"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: -inf positions differ"
    if rows is not None:
        got, ref, base = got[rows], ref[rows], base[rows]
    err, bound = max_err(got, ref), lowp_bound(ref, base, dtype)
    assert err <= bound, f"{name}: max abs error {err:.3e} > bound {bound:.3e} (PyTorch in {dtype}: " \
                         f"{max_err(base, ref):.3e})"


def check_op(fn, inputs, dtype, names, out_names):
    low = [x.to(dtype) for x in inputs]
    r64 = [x.to(torch.float64) for x in low]
    do64 = None
    results = []
    for impl, xs in (("sa", low), ("naive", r64), ("naive", low)):
        leaves = leaf_clones(*xs)
        outs = fn(impl, *leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if do64 is None:
            do64 = torch.randn(outs[0].shape, dtype=torch.float64)
        g = grads(outs[0], leaves, do64.to(outs[0].dtype))
        results.append((outs, g))
    (o_sa, g_sa), (o_64, g_64), (o_lo, g_lo) = results
    for n, a, r, b in zip(out_names, o_sa, o_64, o_lo):
        if n.startswith("lse"):
            # fp32 log-sum-exp from the rounded inputs: fp32 accumulation error only
            assert a.dtype == torch.float32, f"{n}: dtype {a.dtype}, expected float32"
            fin = torch.isfinite(r)
            err = max_err(a, r)
            assert err <= 1e-5 * (1 + r[fin].abs().max().item()), f"{n}: fp32 lse error {err:.3e}"
            b = b.float()
        assert_lowp(a, r, b, dtype, n)
    for n, a, r, b in zip(names, g_sa, g_64, g_lo):
        assert_lowp(a, r, b, dtype, f"d{n}")


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_compress_kv(dtype):
    k, v = randn(2, 100, 2, 64), randn(2, 100, 2, 64)

    def fn(impl, k, v):
        return (sa.compress_kv if impl == "sa" else nv.compress_kv)(k, v, block=16, stride=8)

    check_op(fn, [k, v], dtype, "kv", ["k_cmp"])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (2, 256)])
def test_compressed_attention(dtype, G, D):
    q = randn(1, 120, 2 * G, D)
    kc, vc = randn(1, 14, 2, D), randn(1, 14, 2, D)

    def fn(impl, q, kc, vc):
        return (sa.compressed_attention if impl == "sa" else nv.compressed_attention)(q, kc, vc, block=16, stride=8)

    check_op(fn, [q, kc, vc], dtype, ["q", "k_cmp", "v_cmp"], ["o", "lse"])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("G,D", [(1, 64), (3, 128)])
def test_selected_attention(dtype, G, D, generator):
    q, k, v = qkv(1, 150, 2 * G, 2, D)
    idx = random_indices(150, 2, 4, 16, generator, batch=1)

    def fn(impl, q, k, v):
        return (sa.selected_attention if impl == "sa" else nv.selected_attention)(q, k, v, idx, block=16)

    check_op(fn, [q, k, v], dtype, "qkv", ["o", "lse"])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_flash_attention(dtype, with_bias):
    q, k, v = qkv(2, 70, 4, 2, 64, S=90)
    bias = randn(1, 2, 70, 90) if with_bias else None
    mask = torch.rand(2, 1, 70, 90) > 0.1

    def fn(impl, q, k, v, *b):
        f = sa.flash_attention if impl == "sa" else nv.flash_attention
        return f(q, k, v, causal=True, window=(40, 0), mask=mask, bias=b[0] if b else None, return_lse=True)

    check_op(fn, [q, k, v] + ([bias] if with_bias else []), dtype, ["q", "k", "v", "bias"], ["o", "lse"])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_flash_attention_varlen(dtype):
    lengths = [1, 63, 65, 0, 30]
    cu = cu_seqlens_of(lengths)
    n = sum(lengths)
    q, k, v = randn(n, 4, 64), randn(n, 1, 64), randn(n, 1, 64)

    def fn(impl, q, k, v):
        f = sa.flash_attention if impl == "sa" else nv.flash_attention
        return f(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)

    check_op(fn, [q, k, v], dtype, "qkv", ["o", "lse"])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_nsa_given_indices(dtype, generator):
    """Whole NSA in low precision with the selection fixed (so rounding cannot flip a near-tie)."""
    T, G, Hkv = 130, 2, 2
    q, k, v = qkv(1, T, G * Hkv, Hkv, 64)
    gs = [gates(1, T, G * Hkv) for _ in range(3)]
    cfg = sa.NSAConfig(**TINY)
    idx = nv.nsa_indices(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), cfg)

    def fn(impl, q, k, v, a, b, c):
        f = sa.nsa_attention if impl == "sa" else nv.nsa_attention
        return f(q, k, v, a, b, c, config=cfg, block_indices=idx)

    check_op(fn, [q, k, v, *gs], dtype, ["q", "k", "v", "g_cmp", "g_slc", "g_swa"], ["o"])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_select_blocks_lowp(dtype):
    """Selection from low-precision q/k_cmp (fp32 lse) equals the float64 selection on the same rounded
    inputs, except at near-ties (reference score gap within 1e-4 of the row's largest score)."""
    T = 300
    q = randn(2, T, 4, 64).to(dtype)
    kc = randn(2, (T - 16) // 8 + 1, 2, 64).to(dtype)
    vc = randn(2, kc.shape[1], 2, 64).to(dtype)
    _, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    assert lse.dtype == torch.float32
    kw = dict(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=5)
    got = sa.select_blocks(q, kc, lse, **kw)
    ref = nv.select_blocks(q.double(), kc.double(), lse.double(), **kw)
    if not torch.equal(got, ref):
        scores = nv.selection_scores(q.double(), kc.double(), lse.double(), 16, 8, 32)
        ok, report = selection_gap_ok(got, ref, scores, rtol=1e-4)
        assert ok, indices_mismatch_report(got, ref) + "\n" + report


def ambiguous_query_rows(scores, cfg, rel):
    """bool [T]: query rows where, for some KV head, the last chosen and the first rejected candidate block
    score within rel * (row max) of each other in the float64 reference (a low-precision run may flip them).
    scores [Hkv, T, nsel] of one sequence."""
    Hkv, T, nsel = scores.shape
    t = torch.arange(T)
    cur = (t // cfg.sel_block)[:, None]
    b = torch.arange(nsel)[None, :]
    cand = b <= cur
    forced = ((b < cfg.num_init) | ((b > cur - cfg.num_local) & (b <= cur))) & cand
    key = torch.where(forced[None], torch.full_like(scores, float("inf")), scores)
    key = torch.where(cand[None], key, torch.full_like(key, float("-inf")))
    srt = key.sort(dim=-1, descending=True).values
    count = cand.sum(-1).clamp(max=cfg.num_selected)  # [T]
    out = torch.zeros(T, dtype=torch.bool)
    for ti in range(T):
        c = int(count[ti])
        if c >= int(cand[ti].sum()) or c == 0:
            continue
        for h in range(Hkv):
            last, first_out = srt[h, ti, c - 1].item(), srt[h, ti, c].item()
            if last == float("inf"):
                continue
            rowmax = scores[h, ti][cand[ti]].abs().max().item()
            if last - first_out <= rel * rowmax:
                out[ti] = True
    return out


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_nsa_internal_selection_close(dtype):
    """Whole NSA with its own selection in low precision vs float64 on the rounded inputs, on every query
    row whose selection is not a near-tie at this precision (score gap > 8 eps of the row max)."""
    T, Hq, Hkv = 200, 4, 2
    cfg = sa.NSAConfig(**TINY)
    q, k, v = (x.to(dtype) for x in qkv(1, T, Hq, Hkv, 64))
    gs = [gates(1, T, Hq).to(dtype) for _ in range(3)]
    r = [x.double() for x in (q, k, v, *gs)]
    o = sa.nsa_attention(q, k, v, *gs, config=cfg)
    ref, extras = nv.nsa_attention(*r, config=cfg, return_extras=True)
    base = nv.nsa_attention(q, k, v, *gs, config=cfg, block_indices=extras[0]["indices"][None])
    ex = extras[0]
    scores = nv.selection_scores_seq(r[0][0], ex["k_cmp"], ex["lse_cmp"], cfg.cmp_block, cfg.cmp_stride,
                                     cfg.sel_block, nv.default_scale(64, None))
    amb = ambiguous_query_rows(scores, nv.config_from(cfg), 8 * EPS[dtype])
    assert amb.float().mean() < 0.5, f"{int(amb.sum())}/{T} ambiguous rows: the test input is not informative"
    keep = ~amb
    assert_lowp(o[0][keep], ref[0][keep], base[0][keep], dtype, f"o ({int(keep.sum())}/{T} unambiguous rows)")


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_nsa_internal_selection_runs(dtype):
    """Internal selection in low precision: finite output of the right dtype, and gradients for every input."""
    T = 100
    q, k, v = qkv(2, T, 4, 2, 64, dtype=dtype, requires_grad=True)
    gs = [gates(2, T, 4, dtype=dtype, requires_grad=True) for _ in range(3)]
    o = sa.nsa_attention(q, k, v, *gs, config=sa.NSAConfig(**TINY))
    assert o.dtype == dtype and torch.isfinite(o).all()
    o.float().square().sum().backward()
    for x in (q, k, v, *gs):
        assert x.grad is not None and x.grad.dtype == dtype and torch.isfinite(x.grad).all()
